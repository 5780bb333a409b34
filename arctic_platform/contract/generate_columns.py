"""Generate results as columns of tensors: the bulk form of a rollout on the wire.

Why: the reference form of a generate result is a list of per-sample dicts whose ``token_ids``
and ``logprobs`` are JSON lists. Inside a DSSST1 frame those lists live in the JSON header, so a
normal GRPO rollout (2048 samples x 4096 tokens with logprobs) makes a header larger than the
64 MiB the codec accepts, and encoding it is slower than plain JSON. In the column form every
per-token value is one flat tensor plus per-sample offsets, so the header stays a few kilobytes
whatever the rollout size and the tensors travel as raw bytes.

Who uses which form: a client that asks for columns (``response_options.generate_results =
"columns"`` in the request frame's metadata; this project's client always does) gets
``{"job_id", "result_columns": {...}}``; any other client gets the reference ``{"job_id",
"results": [...]}``. :func:`unpack` turns columns back into exactly the list the reference form
carries, so the caller of ``client.generate`` sees one shape on every backend.

The columns (``N`` samples, ``T`` tokens in all)::

    token_ids      int32 [T]     token_offsets  int64 [N+1]   sample i is token_ids[o[i]:o[i+1]]
    text           uint8 [B]     text_offsets   int64 [N+1]   UTF-8 bytes of each text
    logprob        float32 [T]   has_logprobs   bool [N]      the sampled token's logprob
    logprob_rank   int32 [T]     (when sent) the sampled token's rank, 0 where an entry has none
    top_k          int32 [N]     top_ids int32 [K], top_logprobs float32 [K]: k alternatives
                                                              per token of sample i, in order
    prompt_len, prompt_index, sample_index   int64 [N]
    cached_prompt_tokens                     int64 [N]   prompt tokens the engine's cache held
    finish_reason, stop_reason               JSON lists [N]
    extra                                    JSON list [N] of the fields no column holds

A field is packed into a column only when every sample's value fits it exactly (the per-token
logprob entries must name the sample's own tokens, in order); anything else travels per sample in
``extra``, so packing never loses or alters a field. Logprobs are float32 (the engines compute
them in float32), so they round-trip exactly.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

COLUMNS_KEY = "result_columns"
RESULTS_KEY = "results"
# Where a client asks for columns: op metadata of the request frame.
RESPONSE_OPTIONS_KEY = "response_options"
GENERATE_RESULTS_OPTION = "generate_results"
COLUMNS = "columns"

INT_COLUMNS = ("prompt_len", "prompt_index", "sample_index", "cached_prompt_tokens")
JSON_COLUMNS = ("finish_reason", "stop_reason")
_INT32 = np.iinfo(np.int32)


def wants_columns(frame_metadata: Mapping | None) -> bool:
    """Whether a request frame's op metadata asks for generate results as columns."""
    options = (frame_metadata or {}).get(RESPONSE_OPTIONS_KEY)
    return isinstance(options, Mapping) and options.get(GENERATE_RESULTS_OPTION) == COLUMNS


def request_columns(metadata: Mapping | None = None) -> dict:
    """Op metadata for a generate request frame that asks for columns (merged into ``metadata``)."""
    out = dict(metadata or {})
    options = dict(out.get(RESPONSE_OPTIONS_KEY) or {})
    options[GENERATE_RESULTS_OPTION] = COLUMNS
    out[RESPONSE_OPTIONS_KEY] = options
    return out


def as_columns(result: Mapping) -> dict:
    """A generate op result ``{"job_id", "results": [...]}`` in the column form."""
    out = {k: v for k, v in result.items() if k != RESULTS_KEY}
    out[COLUMNS_KEY] = pack(result[RESULTS_KEY])
    return out


def results_of(result: Any) -> list[dict] | None:
    """The per-sample list of a generate op result in either form (None if it has neither)."""
    if isinstance(result, Mapping):
        if COLUMNS_KEY in result:
            return unpack(result[COLUMNS_KEY])
        result = result.get(RESULTS_KEY)
    return result if isinstance(result, list) else None


# -- packing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building millions of small containers.

    Every few hundred new lists or dicts trigger a collection that walks the young objects, and
    the older generations get walked again as the heap grows: building a rollout's per-token
    entries takes about 4x longer with the collector running. These objects hold no cycles.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def pack(results: Sequence[Mapping]) -> dict[str, Any]:
    """The columns of ``results`` (see the module doc)."""
    with _collector_paused():
        return _pack(results)


def _pack(results: Sequence[Mapping]) -> dict[str, Any]:
    count = len(results)
    extra: list[dict] = [{} for _ in range(count)]
    columns: dict[str, Any] = {"count": count}

    ids = [r.get("token_ids") for r in results]
    if all(_is_int_list(v) for v in ids):
        lengths = np.fromiter((len(v) for v in ids), np.int64, count)
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
        if flat.size and (flat.min() < _INT32.min or flat.max() > _INT32.max):
            raise ValueError("token_ids: a token id does not fit int32")
        columns["token_ids"] = flat.astype(np.int32)
        columns["token_offsets"] = _offsets(lengths)
        columns.update(_pack_logprobs(results, ids, lengths, extra))
    else:
        _to_extra(results, "token_ids", extra)
        _to_extra(results, "logprobs", extra)

    texts = [r.get("text") for r in results]
    if all(isinstance(t, str) for t in texts):
        encoded = [t.encode("utf-8") for t in texts]
        columns["text"] = np.frombuffer(b"".join(encoded), np.uint8).copy()
        columns["text_offsets"] = _offsets(np.fromiter(map(len, encoded), np.int64, count))
    else:
        _to_extra(results, "text", extra)

    for name in INT_COLUMNS:
        values = [r.get(name) for r in results]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            columns[name] = np.asarray(values, dtype=np.int64).reshape(count)
        else:
            _to_extra(results, name, extra)
    for name in JSON_COLUMNS:
        if all(name in r for r in results):
            columns[name] = [r[name] for r in results]
        else:
            _to_extra(results, name, extra)

    packed = {"token_ids", "logprobs", "text", *INT_COLUMNS, *JSON_COLUMNS}
    for i, r in enumerate(results):
        extra[i].update({k: v for k, v in r.items() if k not in packed})
    columns["extra"] = extra if any(extra) else None
    return columns


def _pack_logprobs(results, ids, lengths, extra) -> dict[str, Any]:
    """Logprob columns for the samples whose entries align with their tokens and hold float32
    values; the other samples keep their entries in ``extra``."""
    count = len(results)
    has = np.zeros(count, bool)
    top_k = np.zeros(count, np.int32)
    offsets = _offsets(lengths)
    logprob = np.full(int(lengths.sum()), np.nan, np.float32)
    rank = np.zeros(int(lengths.sum()), np.int32)  # 0: the entry carries no rank
    tops: list[np.ndarray] = []
    for i, r in enumerate(results):
        entries = r.get("logprobs")
        if entries is None:
            if "logprobs" in r:
                extra[i]["logprobs"] = None
            continue
        found = _logprob_arrays(entries, ids[i])
        if found is None:
            extra[i]["logprobs"] = entries
            continue
        values, top, ranks = found
        has[i], top_k[i] = True, top.shape[1]
        logprob[offsets[i] : offsets[i + 1]] = values
        if ranks is not None:
            rank[offsets[i] : offsets[i + 1]] = ranks
        tops.append(top.reshape(-1, 2))
    if not has.any():
        return {}
    top = np.concatenate(tops) if tops else np.zeros((0, 2))
    columns = {
        "logprob": logprob,
        "has_logprobs": has,
        "top_k": top_k,
        "top_ids": top[:, 0].astype(np.int32),
        "top_logprobs": top[:, 1].astype(np.float32),
    }
    if rank.any():
        columns["logprob_rank"] = rank
    return columns


def _logprob_arrays(
    entries: Any, ids: list[int]
) -> tuple[np.ndarray, np.ndarray, list[int] | None] | None:
    """``(logprobs [n], alternatives [n, k, 2], ranks or None)`` when ``entries`` are exactly the
    logprob entries of ``ids`` (``{token_id, logprob, top}`` or ``{token_id, logprob, rank,
    top}`` with a positive int ``rank``, ``k`` ``[id, logprob]`` pairs each, float32 values); None
    when the columns could not reproduce them exactly.

    The checks run as C-level ``map``/``set`` passes: a rollout has millions of entries."""
    if type(entries) is not list or len(entries) != len(ids):
        return None
    sizes = set(map(len, entries)) if set(map(type, entries)) <= {dict} else {0}
    if sizes not in ({3}, {4}, set()):
        return None
    try:
        tokens = [e["token_id"] for e in entries]
        values = [e["logprob"] for e in entries]
        tops = [e["top"] for e in entries]
        ranks = [e["rank"] for e in entries] if sizes == {4} else None
    except KeyError:
        return None
    if ranks is not None and (
        not set(map(type, ranks)) <= {int}
        or min(ranks, default=1) < 1
        or max(ranks, default=1) > _INT32.max
    ):
        return None
    if tokens != ids or not set(map(type, values)) <= {float}:
        return None
    if not set(map(type, tops)) <= {list} or len(set(map(len, tops))) > 1:
        return None
    k = len(tops[0]) if tops else 0
    pairs = [p for top in tops for p in top]
    if not set(map(type, pairs)) <= {list} or not set(map(len, pairs)) <= {2}:
        return None
    pair_ids = [p[0] for p in pairs]
    pair_values = [p[1] for p in pairs]
    if not set(map(type, pair_ids)) <= {int} or not set(map(type, pair_values)) <= {float}:
        return None
    value_array = np.array(values, np.float64)
    top = np.empty((len(entries), k, 2), np.float64)
    top[..., 0].flat = pair_ids
    top[..., 1].flat = pair_values
    if pair_ids and (top[..., 0].min() < _INT32.min or top[..., 0].max() > _INT32.max):
        return None
    if not (_exact_float32(value_array) and _exact_float32(top[..., 1])):
        return None
    return value_array, top, ranks


def _exact_float32(values: np.ndarray) -> bool:
    return bool(np.array_equal(values.astype(np.float32).astype(np.float64), values))


def _is_int_list(value: Any) -> bool:
    return type(value) is list and set(map(type, value)) <= {int}


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _to_extra(results: Sequence[Mapping], name: str, extra: list[dict]) -> None:
    for i, r in enumerate(results):
        if name in r:
            extra[i][name] = r[name]


# -- unpacking ----------------------------------------------------------------------------------


def unpack(columns: Mapping) -> list[dict]:
    """The per-sample list that ``columns`` encodes; ``ValueError`` naming the column if they are
    inconsistent."""
    with _collector_paused():
        return _unpack(columns)


def _unpack(columns: Mapping) -> list[dict]:
    if not isinstance(columns, Mapping):
        raise ValueError(f"{COLUMNS_KEY}: expected an object, got {type(columns).__name__}")
    count = columns.get("count")
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"{COLUMNS_KEY}.count: expected a non-negative integer, got {count!r}")
    out: list[dict] = [{} for _ in range(count)]

    if "text" in columns:
        data = _array(columns, "text", 1).tobytes()
        bounds = _bounds(columns, "text_offsets", count, len(data)).tolist()
        for i in range(count):
            out[i]["text"] = data[bounds[i] : bounds[i + 1]].decode("utf-8")

    if "token_ids" in columns:
        flat = _array(columns, "token_ids", 1)
        bounds = _bounds(columns, "token_offsets", count, len(flat)).tolist()
        ids = flat.tolist()
        for i in range(count):
            out[i]["token_ids"] = ids[bounds[i] : bounds[i + 1]]
        if "has_logprobs" in columns:
            _unpack_logprobs(columns, out, ids, bounds)

    for name in INT_COLUMNS:
        if name in columns:
            values = _array(columns, name, 1)
            if len(values) != count:
                raise ValueError(f"{COLUMNS_KEY}.{name}: {len(values)} values for {count} samples")
            for i, v in enumerate(values.tolist()):
                out[i][name] = v
    for name in JSON_COLUMNS:
        if name in columns:
            values = columns[name]
            if not isinstance(values, list) or len(values) != count:
                raise ValueError(f"{COLUMNS_KEY}.{name}: expected a list of {count} values")
            for i, v in enumerate(values):
                out[i][name] = v
    extra = columns.get("extra")
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != count:
            raise ValueError(f"{COLUMNS_KEY}.extra: expected a list of {count} objects")
        for i, fields in enumerate(extra):
            if not isinstance(fields, dict):
                raise ValueError(f"{COLUMNS_KEY}.extra[{i}]: expected an object")
            out[i].update(fields)
    return out


def _unpack_logprobs(columns: Mapping, out: list[dict], ids: list[int], bounds: list[int]):
    count = len(out)
    has = _array(columns, "has_logprobs", 1)
    top_k = _array(columns, "top_k", 1)
    logprob = _array(columns, "logprob", 1)
    if len(has) != count or len(top_k) != count or len(logprob) != len(ids):
        raise ValueError(f"{COLUMNS_KEY}: logprob columns do not match the token columns")
    top_ids = _array(columns, "top_ids", 1).tolist()
    top_values = _array(columns, "top_logprobs", 1).tolist()
    if len(top_ids) != len(top_values):
        raise ValueError(f"{COLUMNS_KEY}.top_ids: {len(top_ids)} ids for {len(top_values)} values")
    values = logprob.tolist()
    ranks = _array(columns, "logprob_rank", 1).tolist() if "logprob_rank" in columns else None
    if ranks is not None and len(ranks) != len(ids):
        raise ValueError(f"{COLUMNS_KEY}.logprob_rank: does not match the token columns")

    def entry(t: int, top: list) -> dict:
        if ranks is None or not ranks[t]:
            return {"token_id": ids[t], "logprob": values[t], "top": top}
        return {"token_id": ids[t], "logprob": values[t], "rank": ranks[t], "top": top}

    cursor = 0
    for i in np.flatnonzero(has).tolist():
        start, stop = bounds[i], bounds[i + 1]
        k = int(top_k[i])
        if cursor + (stop - start) * k > len(top_ids):
            raise ValueError(f"{COLUMNS_KEY}.top_ids: fewer alternatives than top_k asks for")
        entries = []
        for t in range(start, stop):
            top = [[top_ids[j], top_values[j]] for j in range(cursor, cursor + k)]
            cursor += k
            entries.append(entry(t, top))
        out[i]["logprobs"] = entries


def _array(columns: Mapping, name: str, ndim: int) -> np.ndarray:
    value = columns.get(name)
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # a torch tensor
        value = value.numpy()
    if not isinstance(value, np.ndarray) or value.ndim != ndim:
        raise ValueError(f"{COLUMNS_KEY}.{name}: expected a {ndim}-d array")
    return value


def _bounds(columns: Mapping, name: str, count: int, size: int) -> np.ndarray:
    offsets = _array(columns, name, 1)
    if (
        len(offsets) != count + 1
        or (count >= 0 and len(offsets) and (offsets[0] != 0 or offsets[-1] != size))
        or np.any(np.diff(offsets) < 0)
    ):
        raise ValueError(f"{COLUMNS_KEY}.{name}: offsets do not split {size} values into {count}")
    return offsets
