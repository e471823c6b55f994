"""Run and check an exported ONNX pipeline: the files `Pipeline.export_onnx` writes.

    outputs = pipecompile.outputs.onnx_run.run("out/manifest.json", {"input_ids": ids})   # list of arrays
    chain = pipecompile.outputs.onnx_run.Chain("out/manifest.json")                      # sessions kept
    outputs = chain([ids])                                                    # inputs in order

Stages run in manifest order, each on an onnxruntime `InferenceSession` fed from the values
produced so far (the model's inputs, then every earlier stage's outputs); the result is the
model's flat outputs in the manifest's order. `validate_manifest` checks a manifest against
`manifest.schema.json` (shipped in this package; JSON Schema draft 2020-12, validated by
`jsonschema`, of the [onnx] extra), then checks the wiring: every stage input is a model input or
an earlier stage's output.

(`import onnx` below is the top-level onnx package: imports are absolute.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError, require

__all__ = ["run", "Chain", "load_manifest", "validate_manifest", "SCHEMA_PATH"]

SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")


class Chain:
    """The stages of a manifest as onnxruntime sessions, ready to run many times."""

    def __init__(self, manifest_path: str | os.PathLike, *, providers: Sequence[str] | None = None):
        onnxruntime = require("onnxruntime", purpose="running an ONNX manifest")

        self.path = Path(manifest_path)
        self.manifest = load_manifest(self.path)
        providers = list(providers or ["CPUExecutionProvider"])
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: not the optimizer's constant-folding notes
        self.sessions = [
            onnxruntime.InferenceSession(str(self.path.parent / stage["file"]), options,
                                         providers=providers)
            for stage in self.manifest["stages"]
        ]

    def __call__(self, inputs: Mapping[str, Any] | Sequence[Any]) -> list[Any]:
        """The model's flat outputs (numpy arrays) for `inputs`: a dict by input name, or a
        sequence in the manifest's input order."""
        import numpy as np

        names = self.manifest["inputs"]
        if not isinstance(inputs, Mapping):
            inputs = list(inputs)
            if len(inputs) != len(names):
                raise ConfigError(f"{len(inputs)} inputs given; the manifest takes {len(names)}: "
                                  f"{', '.join(names)}")
            inputs = dict(zip(names, inputs))
        missing = [n for n in names if n not in inputs]
        if missing:
            raise ConfigError(f"inputs {missing} are missing; the manifest takes "
                              f"{', '.join(names)}")
        env = {name: np.asarray(_numpy(value)) for name, value in inputs.items()}
        for stage, session in zip(self.manifest["stages"], self.sessions):
            feed = {name: env[name] for name in stage["inputs"]}
            env.update(zip(stage["outputs"], session.run(stage["outputs"], feed)))
        return [env[name] for name in self.manifest["outputs"]]


def run(
    manifest_path: str | os.PathLike,
    inputs: Mapping[str, Any] | Sequence[Any],
    *,
    providers: Sequence[str] | None = None,
) -> list[Any]:
    """Chain the stages of `manifest_path` through onnxruntime; returns the flat outputs."""
    return Chain(manifest_path, providers=providers)(inputs)


def load_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a manifest.json."""
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; pass the path export_onnx returned") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error})") from None
    validate_manifest(manifest, where=str(path))
    return manifest


def validate_manifest(manifest: Any, *, where: str = "manifest") -> None:
    """Raise ConfigError unless `manifest` matches the schema and its stages are wired."""
    schema = json.loads(SCHEMA_PATH.read_text())
    errors = _check(manifest, schema)
    if not errors:
        known = set(manifest["inputs"])
        for i, stage in enumerate(manifest["stages"]):
            for name in stage["inputs"]:
                if name not in known:
                    errors.append(f"$.stages[{i}].inputs: {name!r} is neither a model input "
                                  f"nor an output of an earlier stage")
            known.update(stage["outputs"])
        errors += [f"$.outputs: {n!r} is produced by no stage" for n in manifest["outputs"]
                   if n not in known]
    if errors:
        raise ConfigError(f"{where} is not a valid pipecompile manifest: " + "; ".join(errors[:5]))


def _check(value: Any, schema: Mapping[str, Any]) -> list[str]:
    """Every way `value` breaks `schema` (JSON Schema draft 2020-12, by jsonschema), each as
    ``<JSON path>: <what>``."""
    jsonschema = require("jsonschema", purpose="validating an ONNX manifest")
    errors = []
    validator = jsonschema.Draft202012Validator(schema)
    for e in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path)):
        if e.validator == "required":
            errors += [f"{e.json_path}: missing key {k!r}" for k in e.validator_value
                       if k not in e.instance]
        elif e.validator == "type":
            errors.append(f"{e.json_path}: expected {e.validator_value}, got "
                          f"{type(e.instance).__name__}")
        else:
            errors.append(f"{e.json_path}: {e.message}")
    return errors


def _numpy(value: Any) -> Any:
    """torch tensors become numpy arrays; everything else is left to numpy."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value
