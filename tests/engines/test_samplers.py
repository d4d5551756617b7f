"""Samplers whose state is the checkpoint's sampler member (spec 4.4, 6.8): restored at any
step, they continue exactly as an uninterrupted sampler does."""

from __future__ import annotations

import json

import pytest
import torch

from kvsp.problems import ProtocolError
from kvsp.records import Sampler
from workers.engines.samplers import TokenSampler, uniform

VOCAB = 50
STEPS = 40

METHODS = [
    ("greedy", {}),
    ("temperature", {"temperature": 0.8}),
    ("top-k", {"k": 5}),
    ("top-k", {"k": 3, "temperature": 2.0}),
    ("top-p", {"p": 0.7}),
    ("top-p", {"p": 0.95, "temperature": 1.5}),
    ("min-p", {"p": 0.1}),
    ("min-p", {"p": 0.05, "temperature": 0.5}),
]


def logits_stream(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(VOCAB, generator=generator) * 3 for _ in range(STEPS)]


def over_the_wire(record: Sampler) -> Sampler:
    return Sampler.from_json(json.loads(json.dumps(record.to_json())))


@pytest.mark.parametrize(("method", "params"), METHODS)
def test_restored_at_every_step_continues_the_same(method, params):
    stream = logits_stream()
    sampler = TokenSampler(method, params, seed=2**64 - 3)
    uninterrupted, records = [], []
    for logits in stream:
        records.append(over_the_wire(sampler.to_record()))
        uninterrupted.append(sampler.sample(logits))
    for step, record in enumerate(records):
        assert record.step == step
        restored = TokenSampler.from_record(record)
        assert [restored.sample(logits) for logits in stream[step:]] == uninterrupted[step:]
    assert sampler.step == STEPS


@pytest.mark.parametrize(("method", "params"), METHODS[1:])
def test_draws_depend_on_the_seed(method, params):
    stream = logits_stream(1)
    first, second = TokenSampler(method, params, seed=1), TokenSampler(method, params, seed=2)
    assert [first.sample(x) for x in stream] != [second.sample(x) for x in stream]


def test_uniform_is_a_function_of_seed_and_step():
    values = [uniform(7, step) for step in range(1000)]
    assert values == [uniform(7, step) for step in range(1000)]
    assert all(0.0 <= value < 1.0 for value in values)
    assert uniform(7, 0) != uniform(8, 0)
    assert 0.45 < sum(values) / len(values) < 0.55


def test_greedy_is_argmax_and_deterministic():
    sampler = TokenSampler()
    assert sampler.deterministic and sampler.to_record().deterministic
    for logits in logits_stream(2):
        assert sampler.sample(logits) == int(torch.argmax(logits))
    tie = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert TokenSampler().sample(tie) == 1


@pytest.mark.parametrize(("method", "params"), METHODS[1:])
def test_only_greedy_is_deterministic(method, params):
    sampler = TokenSampler(method, params)
    assert not sampler.deterministic
    assert sampler.to_record().deterministic is False


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_samples_outside_the_top_k(k):
    sampler = TokenSampler("top-k", {"k": k}, seed=3)
    for logits in logits_stream(3) * 5:
        allowed = set(torch.topk(logits, k).indices.tolist())
        assert sampler.sample(logits) in allowed
        support = set(torch.nonzero(sampler.distribution(logits)).flatten().tolist())
        assert support == allowed


@pytest.mark.parametrize("p", [0.3, 0.8, 0.99])
def test_top_p_samples_the_nucleus(p):
    sampler = TokenSampler("top-p", {"p": p}, seed=4)
    for logits in logits_stream(4) * 5:
        probabilities = torch.softmax(logits.double(), 0)
        order = torch.argsort(probabilities, descending=True)
        mass = torch.cumsum(probabilities[order], 0)
        size = int(torch.searchsorted(mass, torch.tensor([p], dtype=torch.float64))[0]) + 1
        nucleus = set(order[:size].tolist())
        assert mass[size - 1] >= p and (size == 1 or mass[size - 2] < p)
        assert sampler.sample(logits) in nucleus
        support = set(torch.nonzero(sampler.distribution(logits)).flatten().tolist())
        assert support == nucleus


def test_min_p_keeps_tokens_near_the_most_probable():
    sampler = TokenSampler("min-p", {"p": 0.25}, seed=5)
    for logits in logits_stream(5):
        probabilities = torch.softmax(logits.double(), 0)
        allowed = set(torch.nonzero(probabilities >= 0.25 * probabilities.max()).flatten().tolist())
        assert sampler.sample(logits) in allowed


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    sampler = TokenSampler("temperature", {"temperature": 1.0}, seed=6)
    counts = torch.bincount(
        torch.tensor([sampler.sample(logits) for _ in range(3000)]), minlength=3
    )
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_low_temperature_approaches_greedy():
    sampler = TokenSampler("temperature", {"temperature": 0.01}, seed=8)
    for logits in logits_stream(8):
        assert sampler.sample(logits) == int(torch.argmax(logits))


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("temperature", {}),
        ("temperature", {"temperature": 0}),
        ("top-k", {"k": 0}),
        ("top-k", {"k": 2.5}),
        ("top-p", {"p": 1.5}),
        ("top-p", {"p": 0}),
        ("min-p", {}),
        ("min-p", {"p": 0.1, "temperature": -1}),
        ("top-p", {"p": 0.9, "repetition_penalty": 1.1}),
        ("greedy", {"temperature": 0.5}),
        ("beam", {}),
    ],
)
def test_bad_parameters_are_refused(method, params):
    with pytest.raises(ProtocolError) as raised:
        TokenSampler(method, params)
    assert raised.value.problem == "kvsp-invalid-record"


def test_seed_and_step_are_unsigned_64_bit():
    with pytest.raises(ProtocolError):
        TokenSampler(seed=-1)
    with pytest.raises(ProtocolError):
        TokenSampler(seed=2**64)
    with pytest.raises(ProtocolError):
        TokenSampler(step=-1)


def test_nan_logits_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        TokenSampler("top-p", {"p": 0.5}).sample(torch.tensor([0.0, float("nan")]))
