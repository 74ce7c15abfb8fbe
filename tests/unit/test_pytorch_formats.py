"""Reading timm and transformers checkpoints without PyTorch (runner/checkpoints/state_dicts.py,
timm_format.py, pytorch_formats.py): the .safetensors reader (shapes from the header alone,
bfloat16, a truncated file found before any use), where a prefix token's position row goes, which
model.* keys the files state and which they leave to the command, and which of them a fine-tune
may change. The forward pass against the libraries themselves is tests/export's."""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from formats import state_dicts as sd

from runner.checkpoints import state_dicts, weights
from runner.config import relations
from runner.config.schema import ModelConfig, TrainTask
from runner.errors import CheckpointError


def _safetensors(path, arrays: dict[str, np.ndarray], dtype: str) -> None:
  """A .safetensors file written by hand: the format's header, then the raw bytes."""
  header, data, at = {}, b"", 0
  for name, array in arrays.items():
    raw = np.ascontiguousarray(array).tobytes()
    header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [at, at + len(raw)]}
    data, at = data + raw, at + len(raw)
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_safetensors_are_read_from_the_header_and_bfloat16(tmp_path):
  values = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
  path = tmp_path / "w.safetensors"
  _safetensors(path, {"a": values.astype(ml_dtypes.bfloat16)}, "BF16")
  shapes = state_dicts.read(path, data=False)
  assert shapes["a"].shape == (3, 4) and shapes["a"].strides == (0, 0)  # no data behind it
  np.testing.assert_array_equal(np.asarray(state_dicts.read(path)["a"], np.float32), values)


def test_a_truncated_safetensors_file_is_found_from_its_header(tmp_path):
  path = sd.write(tmp_path / "vit.safetensors", sd.timm_shapes())
  path.write_bytes(path.read_bytes()[:-10])
  with pytest.raises(CheckpointError, match="truncated"):
    state_dicts.read(path, data=False)


def test_a_class_tokens_position_row_is_folded_into_it(tmp_path):
  """timm adds pos_embed's first row to the class token (no_embed_class=False): that token's
  input, a constant, is vmoe's cls; the patches keep the other rows."""
  path = sd.write(tmp_path / "vit.safetensors", sd.timm_shapes())
  tensors = state_dicts.read(path)
  ours = weights.open(str(path)).load()[0]
  np.testing.assert_array_equal(ours["cls"], tensors["cls_token"] + tensors["pos_embed"][:, :1])
  np.testing.assert_array_equal(ours["pos_embedding"], tensors["pos_embed"][:, 1:])
  qkv = ours["block_0"]["attention"]["qkv_kernel"]  # (D, 3, H, hd): q, k, v of timm's rows
  w = tensors["blocks.0.attn.qkv.weight"]
  np.testing.assert_array_equal(qkv[:, 1].reshape(192, 192), w[192:384].T)


def test_the_files_state_the_model_keys(tmp_path):
  """A transformers folder states every key; a bare timm state_dict not its activation."""
  vit = weights.open(str(sd.folder(tmp_path / "vit", sd.VIT_CONFIG, sd.vit_shapes())))
  assert vit.kind == weights.TRANSFORMERS and not vit.architecture.unstated
  assert vit.architecture.stated["layer_norm_eps"] == 1e-12
  assert vit.architecture.stated["activation"] == "gelu"
  timm = weights.open(str(sd.write(tmp_path / "t.safetensors", sd.timm_shapes())))
  assert timm.kind == weights.TIMM and timm.architecture.unstated == ("activation",)
  assert timm.architecture.stated["num_heads"] == 3  # timm's head count for a width of 192


def test_a_fine_tune_keeps_what_the_vit_computes_and_may_change_the_rest(tmp_path):
  path = str(sd.folder(tmp_path / "vit", sd.VIT_CONFIG, sd.vit_shapes()))

  def problem(**model):
    base = dict(name="vmoe_tiny", image_size=48, patch_size=8, hidden_size=32, num_layers=1,
                mlp_dim=64, num_heads=2)
    run = TrainTask(model=ModelConfig(**{**base, **model}), data=None)
    run.init.checkpoint = path
    return relations.model_is_the_checkpoints_vit(run, weights.Checkpoints())

  # Another resolution and a new head are a fine-tune's; the GELU and the LayerNorms are kept.
  assert problem(activation="gelu", layer_norm_eps=1e-12) is None
  assert "model.activation=gelu, model.layer_norm_eps=1e-12" in problem()
