"""The Tinker SDK's protobuf messages, declared here and decoded/encoded with ``protobuf``.

The SDK sends ``forward_backward`` bodies as protobuf and accepts ``forward``/``forward_backward``
and ``sample`` results only as protobuf (``Accept: application/x-protobuf``). The schema is the
SDK's public ``tinker_public.proto`` (package ``tinker_public``), limited to the messages this
server reads or writes; fields it does not declare (provenance spans, image sizes) are skipped by
the parser as unknown fields. It is built at import time as a ``FileDescriptorProto``, so no
``protoc`` step and no generated code are needed.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"
CONTENT_TYPE = "application/x-protobuf"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "bytes": _F.TYPE_BYTES,
    "string": _F.TYPE_STRING,
    "bool": _F.TYPE_BOOL,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
}
_ENUMS = {
    "StopReason": [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)],
    "DType": [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ],
}
# message -> [(number, name, type, flags)]; type is a scalar, "enum:<E>", "msg:<M>" or
# "map:<M>" (map<string, M>, M a message or "double"); flags: "repeated" or "oneof:<name>".
_MESSAGES: dict[str, list[tuple[int, str, str, str]]] = {
    "SparseCsr": [
        (1, "values", "bytes", ""),
        (2, "crow_indices", "bytes", ""),
        (3, "col_indices", "bytes", ""),
    ],
    "Tensor": [
        (1, "dense", "bytes", "oneof:encoding"),
        (2, "sparse_csr", "msg:SparseCsr", "oneof:encoding"),
        (3, "dtype", "enum:DType", ""),
        (4, "shape", "int64", "repeated"),
    ],
    "EncodedTextChunk": [(1, "tokens", "bytes", "")],
    "ImageChunk": [(1, "data", "bytes", ""), (2, "format", "string", "")],
    "DmelChunk": [(1, "dmel", "bytes", "")],
    "Chunk": [
        (1, "encoded_text", "msg:EncodedTextChunk", "oneof:chunk"),
        (2, "image", "msg:ImageChunk", "oneof:chunk"),
        (3, "dmel", "msg:DmelChunk", "oneof:chunk"),
    ],
    "Datum": [
        (1, "model_input", "msg:Chunk", "repeated"),
        (2, "loss_fn_inputs", "map:Tensor", ""),
    ],
    "LossConfigValue": [
        (1, "number", "double", "oneof:value"),
        (2, "text", "string", "oneof:value"),
    ],
    "ForwardBackwardRequest": [
        (1, "model_id", "string", ""),
        (2, "seq_id", "int32", ""),
        (3, "data", "msg:Datum", "repeated"),
        (4, "loss_fn", "string", ""),
        (5, "loss_fn_config", "map:double", ""),
        (6, "forward_only", "bool", ""),
        (7, "loss_fn_config_v2", "map:LossConfigValue", ""),
    ],
    "BatchedTensor": [
        (1, "data", "bytes", ""),
        (2, "offsets", "bytes", ""),
        (3, "dtype", "enum:DType", ""),
        (4, "trailing_shape", "int64", "repeated"),
    ],
    "ArrayRecord": [
        (1, "type_tag", "string", ""),
        (2, "fields", "map:BatchedTensor", ""),
        (3, "num_datums", "int64", ""),
    ],
    "ForwardBackwardOutput": [
        (1, "loss_fn_output_type", "string", ""),
        (2, "loss_fn_outputs", "msg:ArrayRecord", "repeated"),
        (3, "metrics", "map:double", ""),
    ],
    "TopkLogprobs": [
        (1, "token_ids", "bytes", ""),
        (2, "logprobs", "bytes", ""),
        (3, "k", "uint32", ""),
        (4, "length", "uint32", ""),
    ],
    "SampledSequence": [
        (1, "stop_reason", "enum:StopReason", ""),
        (2, "tokens", "bytes", ""),
        (3, "logprobs", "bytes", ""),
        (4, "topk_sampled_logprobs", "msg:TopkLogprobs", ""),
    ],
    "SampleResponse": [
        (1, "sequences", "msg:SampledSequence", "repeated"),
        (2, "prompt_logprobs", "bytes", ""),
        (3, "topk_prompt_logprobs", "msg:TopkLogprobs", ""),
        (4, "prompt_cache_hit_tokens", "int32", ""),
    ],
}


def _set_type(field: descriptor_pb2.FieldDescriptorProto, kind: str) -> None:
    if kind in _SCALARS:
        field.type = _SCALARS[kind]
        return
    prefix, name = kind.split(":")
    field.type = _F.TYPE_ENUM if prefix == "enum" else _F.TYPE_MESSAGE
    field.type_name = f".{PACKAGE}.{name}"


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(
        name="arctic_platform/tinker_public.proto", package=PACKAGE, syntax="proto3"
    )
    for name, values in _ENUMS.items():
        enum = fd.enum_type.add(name=name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for name, fields in _MESSAGES.items():
        message = fd.message_type.add(name=name)
        oneofs: dict[str, int] = {}
        for number, field_name, kind, flags in fields:
            field = message.field.add(name=field_name, number=number, label=_F.LABEL_OPTIONAL)
            if kind.startswith("map:"):
                entry_name = "".join(p.title() for p in field_name.split("_")) + "Entry"
                entry = message.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, type=_F.TYPE_STRING)
                value = entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL)
                _set_type(value, kind[4:] if kind[4:] in _SCALARS else "msg:" + kind[4:])
                field.label = _F.LABEL_REPEATED
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{PACKAGE}.{name}.{entry_name}"
                continue
            _set_type(field, kind)
            if flags == "repeated":
                field.label = _F.LABEL_REPEATED
            elif flags.startswith("oneof:"):
                group = flags[len("oneof:") :]
                if group not in oneofs:
                    oneofs[group] = len(message.oneof_decl)
                    message.oneof_decl.add(name=group)
                field.oneof_index = oneofs[group]
    return fd


_CLASSES = message_factory.GetMessages([_file_descriptor()], pool=descriptor_pool.DescriptorPool())


def message_class(name: str):
    """The generated message class ``tinker_public.<name>``."""
    return _CLASSES[f"{PACKAGE}.{name}"]


ForwardBackwardRequest = message_class("ForwardBackwardRequest")
ForwardBackwardOutput = message_class("ForwardBackwardOutput")
SampleResponse = message_class("SampleResponse")
Tensor = message_class("Tensor")

DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
STOP_REASON = {"stop": 0, "length": 1}
