"""``arctic-platform export-model``: a built-in model as a plain HF folder (verl needs a path)."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from arctic_platform.cli import app
from arctic_platform.engine.config import ModelConfig
from arctic_platform.engine.models import load_causal_lm, load_tokenizer


def test_exported_folder_loads_as_the_builtin_model(tmp_path):
    target = tmp_path / "tiny"
    result = CliRunner().invoke(app, ["export-model", "builtin:tiny", str(target)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(target)
    exported = load_causal_lm(ModelConfig(name=str(target), device="cpu"))
    builtin = load_causal_lm(ModelConfig(name="builtin:tiny", device="cpu"))
    for (name, a), (_, b) in zip(
        exported.state_dict().items(), builtin.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    tokenizer = load_tokenizer(ModelConfig(name=str(target)))
    assert (
        tokenizer("1+2=")["input_ids"]
        == load_tokenizer(ModelConfig(name="builtin:tiny"))("1+2=")["input_ids"]
    )


def test_export_refuses_other_models_and_full_folders(tmp_path):
    runner = CliRunner()
    other = runner.invoke(app, ["export-model", "Qwen/Qwen3-0.6B", str(tmp_path / "q")])
    assert other.exit_code != 0 and "only builtin: models" in other.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    full = runner.invoke(app, ["export-model", "builtin:tiny", str(tmp_path / "full")])
    assert full.exit_code != 0 and "not empty" in full.output
    (tmp_path / "a-file").write_text("")  # a traceback before
    into_file = runner.invoke(app, ["export-model", "builtin:tiny", str(tmp_path / "a-file")])
    assert into_file.exit_code == 2 and "destination" in into_file.output
    assert into_file.exception is None or isinstance(into_file.exception, SystemExit)
