"""The reference model directory: a small Llama-architecture model from seeded random weights.

DESIGN.md section 8 asks for a model whose Compatibility Descriptor (spec 4.1) is computed from
real files, with nothing downloaded. ``create_reference_model`` writes a Hugging Face style
directory: ``config.json``, the weights as ``model.safetensors`` and a byte-level BPE tokenizer
as ``tokenizer.json``, trained on a text kept in this module. Every file is a function of the
arguments alone, so the same arguments give the same octets, the same ``model_digest`` and
``tokenizer_digest``, and the same Compatibility ID on every machine with the same torch,
transformers and tokenizers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from kvsp.compat import descriptor_from_model_dir

REFERENCE_MODEL = "kvsp-reference-llama"

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"

# Ids 0, 1 and 2; the trainer places special tokens before the byte alphabet.
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 2
_BYTE_ALPHABET = 256

# The tokenizer's merges are learned from this text; any text would do, but it must never
# change, because the tokenizer file (and so tokenizer_digest) is a function of it.
TOKENIZER_TEXT = """\
A transformer keeps, for every token it has read and for every layer, a key and a value vector.
Attention reads them again at each step, so the cache grows with the length of the context and
with the number of requests served at once. Keeping the cache after a request ends lets the next
request that shares the same prefix skip the work of reading it again. Moving the cache between
memory tiers is slow when it is done synchronously, so a receiver starts on the first layer as
soon as it arrives and reads the later layers while it computes. A block holds the keys and values
of a fixed number of tokens, and its name covers the whole prefix before it, so two requests that
share a system prompt share its blocks. The placement controller compares the time to fetch the
blocks with the time to compute them again, and sends the request where the total is lowest.
When an instance fails, another one loads the blocks of the session, recomputes the tokens that
no block covers, restores the sampler, and continues where the first one stopped.
"""


def reference_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens, trained on TOKENIZER_TEXT.

    Every byte is in the vocabulary, so any text round-trips through it.
    """
    minimum = len(SPECIAL_TOKENS) + _BYTE_ALPHABET
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum}: the specials and all 256 bytes")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    return tokenizer


def reference_config(
    *,
    layers: int,
    hidden_size: int,
    heads: int,
    kv_heads: int,
    vocab_size: int,
    rope_theta: float,
    max_positions: int,
) -> LlamaConfig:
    """The Llama configuration the reference model is built from."""
    if hidden_size % heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of heads {heads}")
    if heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def _write_weights(config: LlamaConfig, seed: int, path: Path) -> None:
    # A private RNG state: the caller's global torch RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})


def _same_octets(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()
    except FileNotFoundError:
        return False


def create_reference_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    layers: int = 4,
    hidden_size: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 320,
    rope_theta: float = 10000.0,
    max_positions: int = 4096,
) -> Path:
    """Write the reference model into ``path`` (created if needed) and return it.

    The defaults give 4 layers, 2 KV heads of dimension 16 and a vocabulary of 320, small
    enough to run on a CPU in milliseconds. Creating into a directory that already holds the
    same model changes nothing; a file that differs is replaced atomically, so a reader never
    sees a half-written model. Another ``*.safetensors`` file in the directory would enter the
    model digest (spec 4.1 hashes them all), so its presence is an error.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    strays = sorted(
        entry.name
        for entry in directory.iterdir()
        if entry.name.endswith(".safetensors") and entry.name != WEIGHTS_FILE
    )
    if strays:
        raise ValueError(
            f"{directory} holds other weight files ({', '.join(strays)}) that would enter "
            "its model digest"
        )
    config = reference_config(
        layers=layers,
        hidden_size=hidden_size,
        heads=heads,
        kv_heads=kv_heads,
        vocab_size=vocab_size,
        rope_theta=rope_theta,
        max_positions=max_positions,
    )
    with tempfile.TemporaryDirectory(dir=directory, prefix=".create-") as staging_name:
        staging = Path(staging_name)
        reference_tokenizer(vocab_size).save(str(staging / TOKENIZER_FILE))
        (staging / CONFIG_FILE).write_text(config.to_json_string(use_diff=False), "utf-8")
        _write_weights(config, seed, staging / WEIGHTS_FILE)
        # safetensors creates its file readable by the owner alone; the model is no secret, so
        # it gets the mode the umask gave the config.
        shutil.copymode(staging / CONFIG_FILE, staging / WEIGHTS_FILE)
        for name in (CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE):
            if not _same_octets(staging / name, directory / name):
                os.replace(staging / name, directory / name)
    return directory


def reference_descriptor(
    path: str | os.PathLike, *, block_tokens: int, model: str = REFERENCE_MODEL
) -> dict:
    """The Compatibility Descriptor of a model directory, computed from its files (spec 4.1)."""
    return descriptor_from_model_dir(path, model=model, block_tokens=block_tokens)
