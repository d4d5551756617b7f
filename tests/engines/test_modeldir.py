"""The reference model directory: reproducible files and the descriptor computed from them
(spec 4.1, DESIGN.md section 8)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvsp.compat import compat_id_hex, parse_descriptor
from kvsp.registries import LAYOUT_1
from tests.support.processes import PYTHON, ROOT
from workers.engines.modeldir import (
    CONFIG_FILE,
    REFERENCE_MODEL,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    create_reference_model,
    reference_descriptor,
    reference_tokenizer,
)

FILES = (CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE)


def octets(directory) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in FILES}


def test_same_arguments_give_the_same_octets_in_another_process(model_dir, tmp_path):
    # A different hash seed and thread count rule out dict or set ordering and threaded
    # reductions leaking into the files.
    other = tmp_path / "again"
    script = (
        "import sys\n"
        "from workers.engines.modeldir import create_reference_model\n"
        "create_reference_model(sys.argv[1])\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    result = subprocess.run(
        [PYTHON, "-c", script, str(other)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert octets(other) == octets(model_dir)
    assert reference_descriptor(other, block_tokens=16) == reference_descriptor(
        model_dir, block_tokens=16
    )


def test_creating_again_leaves_the_files_untouched(model_dir):
    before = octets(model_dir)
    inodes = {name: (model_dir / name).stat().st_ino for name in FILES}
    assert create_reference_model(model_dir) == model_dir
    assert octets(model_dir) == before
    assert {name: (model_dir / name).stat().st_ino for name in FILES} == inodes
    assert sorted(path.name for path in model_dir.iterdir()) == sorted(FILES)


def test_creating_over_a_changed_file_restores_it(tmp_path):
    directory = create_reference_model(tmp_path / "model")
    before = octets(directory)
    (directory / WEIGHTS_FILE).write_bytes(b"not the weights")
    create_reference_model(directory)
    assert octets(directory) == before


def test_another_weight_file_in_the_directory_is_refused(tmp_path):
    (tmp_path / "adapter.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="adapter.safetensors"):
        create_reference_model(tmp_path)


def test_seed_changes_the_weights_and_nothing_else(model_dir, tmp_path):
    other = create_reference_model(tmp_path, seed=1)
    first = reference_descriptor(model_dir, block_tokens=16)
    second = reference_descriptor(other, block_tokens=16)
    assert second["model_digest"] != first["model_digest"]
    assert second["tokenizer_digest"] == first["tokenizer_digest"]
    assert {k: v for k, v in second.items() if k != "model_digest"} == {
        k: v for k, v in first.items() if k != "model_digest"
    }
    assert compat_id_hex(second) != compat_id_hex(first)


def test_descriptor_states_the_geometry_of_the_config(model_dir):
    config = json.loads((model_dir / CONFIG_FILE).read_text())
    descriptor = reference_descriptor(model_dir, block_tokens=16)
    assert descriptor == parse_descriptor(json.dumps(descriptor))
    assert descriptor["model"] == REFERENCE_MODEL
    assert descriptor["layers"] == config["num_hidden_layers"] == 4
    assert descriptor["kv_heads"] == config["num_key_value_heads"] == 2
    assert descriptor["head_dim"] == config["hidden_size"] // config["num_attention_heads"] == 16
    assert descriptor["kv_dtype"] == config["dtype"] == "float32"
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert descriptor["positional"] == "rope;theta=10000"
    assert descriptor["block_tokens"] == 16
    assert descriptor["layout"] == LAYOUT_1
    assert "adapters" not in descriptor
    assert reference_descriptor(model_dir, block_tokens=32)["block_tokens"] == 32


def test_geometry_and_theta_follow_the_arguments(tmp_path):
    directory = create_reference_model(
        tmp_path, layers=2, hidden_size=96, heads=4, kv_heads=4, rope_theta=500000.0
    )
    descriptor = reference_descriptor(directory, block_tokens=8)
    assert (descriptor["layers"], descriptor["kv_heads"], descriptor["head_dim"]) == (2, 4, 24)
    assert descriptor["positional"] == "rope;theta=500000"


@pytest.mark.parametrize(
    "arguments",
    [{"hidden_size": 66}, {"heads": 4, "kv_heads": 3}, {"vocab_size": 200}],
)
def test_impossible_shapes_are_refused(tmp_path, arguments):
    with pytest.raises(ValueError):
        create_reference_model(tmp_path, **arguments)


def test_tokenizer_round_trips_any_text_and_fills_the_vocabulary():
    tokenizer = reference_tokenizer(320)
    assert tokenizer.get_vocab_size() == 320
    for text in ("", "plain words", "ünïcødé ✓ and \x00 control", "KVSP-BLOCK-1 " * 5):
        ids = tokenizer.encode(text).ids
        assert all(0 <= token < 320 for token in ids)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("the cache of the layer").ids) < len("the cache of the layer")


def test_engines_import_no_django():
    script = (
        "import json, sys\n"
        "import workers.engines.reference, workers.engines.samplers\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('django', 'rest_framework', 'celery'))))"
    )
    result = subprocess.run(
        [PYTHON, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
