"""Where a stage's weights come from, decided once at its end: each case, with plain values."""

from __future__ import annotations

import itertools

import pytest

from stagesafe.stages.weight_source import WeightSource, weight_sources

STREAMED, MASTERS, BUILT, CHECKPOINT, ENTRY, HANDOFF = (
    WeightSource.STREAMED, WeightSource.MASTERS, WeightSource.BUILT, WeightSource.CHECKPOINT, WeightSource.ENTRY,
    WeightSource.HANDOFF,
)
_FACTS = ("engine", "gather", "trained", "meta", "built_here", "loaded", "in_handoff")


def _sources(**facts: bool) -> tuple[WeightSource, ...]:
    return weight_sources(**{name: facts.get(name, False) for name in _FACTS})


@pytest.mark.parametrize(
    "facts,expected",
    [
        # a fit that every rank ended: the engine's fp32 masters, else the weights it started with
        ({"engine": True, "gather": True, "trained": True}, (MASTERS, ENTRY)),
        # ... whose module holds meta tensors between stages: streamed to the handoff; a failed write keeps the
        # masters in the module (never the handoff, which does not hold them)
        ({"engine": True, "gather": True, "trained": True, "meta": True}, (STREAMED, MASTERS, ENTRY)),
        ({"engine": True, "gather": True, "trained": True, "meta": True, "in_handoff": True},
         (STREAMED, MASTERS, ENTRY)),
        # an inference stage: the weights it started with; zero.Init's layers from the engine
        ({"engine": True, "gather": True}, (ENTRY,)),
        ({"engine": True, "gather": True, "built_here": True}, (BUILT, ENTRY)),
        ({"engine": True, "gather": True, "built_here": True, "meta": True, "in_handoff": True}, (BUILT, HANDOFF)),
        # a checkpoint loaded during an inference stage
        ({"engine": True, "gather": True, "loaded": True}, (CHECKPOINT, ENTRY)),
        ({"engine": True, "gather": True, "loaded": True, "meta": True, "in_handoff": True}, (CHECKPOINT, HANDOFF)),
        # a fit with ckpt_path: training changed the loaded weights, the masters win
        ({"engine": True, "gather": True, "trained": True, "loaded": True}, (MASTERS, ENTRY)),
        # some rank is elsewhere: no gather, so no engine weights; a loaded checkpoint is local
        ({"engine": True, "trained": True}, (ENTRY,)),
        ({"engine": True, "trained": True, "meta": True}, (ENTRY,)),
        ({"engine": True, "trained": True, "loaded": True}, (CHECKPOINT, ENTRY)),
        ({"engine": True, "built_here": True}, (ENTRY,)),
        # no engine (it failed to build)
        ({"gather": True, "trained": True}, (ENTRY,)),
        ({"gather": True, "trained": True, "meta": True, "in_handoff": True}, (HANDOFF,)),
        # a module of meta tensors whose handoff holds its weights takes nothing back; without one, its entry's
        ({"engine": True, "gather": True, "meta": True, "in_handoff": True}, (HANDOFF,)),
        ({"engine": True, "gather": True, "meta": True}, (ENTRY,)),
    ],
)
def test_each_case_takes_the_weights_from_its_place_then_falls_back(facts, expected):
    assert _sources(**facts) == expected


def test_in_every_case_the_last_source_cannot_fail_and_only_a_trained_engine_gives_new_weights():
    for values in itertools.product([False, True], repeat=len(_FACTS)):
        facts = dict(zip(_FACTS, values))
        sources = weight_sources(**facts)
        assert sources[-1] in (ENTRY, HANDOFF) and all(s not in (ENTRY, HANDOFF) for s in sources[:-1]), facts
        assert len(set(sources)) == len(sources), facts
        trained_first = sources[0].trained
        assert trained_first == (facts["engine"] and facts["gather"] and facts["trained"]), facts
        assert (sources[0] is STREAMED) == (trained_first and facts["meta"]), facts


def test_only_the_engines_trained_weights_count_as_trained():
    assert {s for s in WeightSource if s.trained} == {STREAMED, MASTERS}
