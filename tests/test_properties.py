"""Property-based tests of the handoff store (hypothesis): random state dicts round-trip bit for bit, and no
damage to a shard's bytes ever loads.

State dicts mix fp32, bf16, fp16, fp64, fp8 and integer and bool buffers; 0-d, zero-size, non-contiguous
(transposed, strided, expanded) tensors; tied names (the very same view stored twice); overlapping views and
views of one storage as another dtype; unicode names. They are written with a random shard size and worker
count to memory:// or a local folder. Deterministic (``derandomize``) and bounded, so CI always runs the same
examples.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagesafe import load_state_dict, read_manifest, save_state_dict, verify
from stagesafe.errors import HandoffCorruptError

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]

# Names: any unicode a user could put in a module path (no lone surrogates, which no UTF-8 file can hold, and
# not safetensors' reserved "__metadata__": see tests/test_reliability.py for both).
NAMES = st.text(
    alphabet=st.characters(exclude_categories=("Cs",)),
    min_size=1,
    max_size=24,
).filter(lambda n: n != "__metadata__")


@st.composite
def tensors(draw) -> torch.Tensor:
    """A fresh tensor of any supported dtype with arbitrary bits (NaN payloads, -0.0, subnormals, ...)."""
    dtype = draw(st.sampled_from(DTYPES))
    dims = draw(st.sampled_from([0, 1, 2, 2, 3]))
    shape = draw(st.lists(st.integers(0, 5), min_size=dims, max_size=dims))
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)  # a bool byte other than 0/1 is not a valid value
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


@st.composite
def derived(draw, base: torch.Tensor) -> torch.Tensor:
    """A view of ``base``: itself (a tie), a transpose, a strided slice, an expansion, another dtype."""
    kind = draw(st.sampled_from(["same", "transpose", "slice", "expand", "reinterpret", "unsqueeze"]))
    if kind == "same":
        return base
    if kind == "transpose" and base.dim() >= 2:
        return base.transpose(0, base.dim() - 1)
    if kind == "slice" and base.dim() >= 1 and base.shape[0] > 0:
        step = draw(st.integers(1, 3))
        start = draw(st.integers(0, base.shape[0] - 1))
        return base[start::step]
    if kind == "expand" and base.dim() >= 1:
        return base.unsqueeze(0).expand(draw(st.integers(0, 3)), *base.shape)
    if kind == "reinterpret" and base.is_contiguous() and base.dim() >= 1 and base.element_size() == 2:
        return base.view(torch.int16 if base.dtype != torch.int16 else torch.float16)
    return base.unsqueeze(-1)


@st.composite
def state_dicts(draw) -> dict[str, torch.Tensor]:
    names = draw(st.lists(NAMES, min_size=0, max_size=8, unique=True))
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if out and draw(st.booleans()):
            base = out[draw(st.sampled_from(sorted(out)))]
            out[name] = draw(derived(base))
        else:
            out[name] = draw(tensors())
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _view_key(t: torch.Tensor):
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _Location:
    """A fresh handoff URL on memory:// or on the local disk."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "memory":
            self.root = f"/stagesafe-properties/{uuid.uuid4().hex}"
            self.url = f"memory://{self.root}"
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="stagesafe-properties-")
            self.url = f"{self._dir.name}/handoff"

    def close(self) -> None:
        if self.kind == "memory":
            fs = fsspec.filesystem("memory")
            if fs.exists(self.root):
                fs.rm(self.root, recursive=True)
        else:
            self._dir.cleanup()


@settings(SETTINGS, max_examples=200)
@given(
    sd=state_dicts(),
    shard_size=st.integers(1, 2048),
    workers=st.sampled_from([1, 3]),
    kind=st.sampled_from(["memory", "local"]),
)
def test_random_state_dicts_round_trip_bitwise(sd, shard_size, workers, kind):
    where = _Location(kind)
    try:
        originals = {name: (t.dtype, tuple(t.shape), _bits(t).clone()) for name, t in sd.items()}
        manifest = save_state_dict(sd, where.url, max_shard_size=shard_size, workers=workers)
        loaded = load_state_dict(where.url, workers=workers)
        assert list(loaded) == list(sd)  # names, in state-dict order
        for name, tensor in loaded.items():
            dtype, shape, data = originals[name]
            assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name
            assert torch.equal(_bits(tensor), data), name
            assert torch.equal(_bits(sd[name]), data), f"{name}: the caller's tensor was changed"
        # The very same view under two names (tied weights) comes back as one tensor; nothing else is shared.
        first: dict = {}
        for name, tensor in sd.items():
            key = _view_key(tensor)
            if key is not None and key in first:
                assert loaded[name] is loaded[first[key]], (name, first[key])
            else:
                if key is not None:
                    first[key] = name
                assert not any(loaded[name] is loaded[o] for o in first.values() if o != name), name
        assert verify(where.url, workers=workers) == manifest
        assert manifest["total_size"] == sum(
            t.numel() * t.element_size() for n, t in sd.items() if n not in manifest["aliases"]
        )
    finally:
        where.close()


# -- damage anywhere in a shard is refused ----------------------------------------------------------------------


@functools.cache
def _template() -> tuple[str, dict]:
    """One handoff, written once per session: several shards (a tied name, bf16, int and bool buffers)."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "embed.weight": torch.randn(7, 5, generator=g),
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(12),
        "mask": torch.tensor([True, False, True]),
    }
    sd["head.weight"] = sd["embed.weight"]
    url = f"{_TEMPLATES.name}/handoff"
    save_state_dict(sd, url, max_shard_size=64)
    return url, read_manifest(url)


_TEMPLATES = tempfile.TemporaryDirectory(prefix="stagesafe-properties-")


def _saved(tmp: str) -> tuple[str, dict]:
    """A copy of the template handoff under ``tmp``, to damage."""
    template, manifest = _template()
    url = f"{tmp}/handoff"
    shutil.copytree(template, url)
    return url, manifest


def _a_shard(data: st.DataObject, tmp: str) -> tuple[str, str, bytes]:
    """A copy of the template handoff under ``tmp``, one of its shards drawn, and that shard's bytes."""
    url, manifest = _saved(tmp)
    shard = data.draw(st.sampled_from(sorted(manifest["shards"])))
    return url, shard, (Path(url) / shard).read_bytes()


def _refused(url: str, shard: str, damaged: bytes) -> None:
    """``shard`` replaced by ``damaged``: verify and load both refuse it, naming it."""
    (Path(url) / shard).write_bytes(damaged)
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError, match=f"shard {shard!r}"):
            reader(url)


@SETTINGS
@given(data=st.data())
def test_any_flipped_bit_in_any_shard_is_refused_naming_the_shard(data):
    with tempfile.TemporaryDirectory() as tmp:
        url, shard, raw = _a_shard(data, tmp)
        raw = bytearray(raw)
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        _refused(url, shard, bytes(raw))


@SETTINGS
@given(data=st.data())
def test_any_truncation_or_extension_of_a_shard_is_refused(data):
    with tempfile.TemporaryDirectory() as tmp:
        url, shard, raw = _a_shard(data, tmp)
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        else:
            raw = raw + data.draw(st.binary(min_size=1, max_size=64))
        _refused(url, shard, raw)


@SETTINGS
@given(data=st.data())
def test_a_shard_of_another_handoff_in_its_place_is_refused(data):
    """A shard file from an earlier generation or another run, with the right name, is not taken."""
    with tempfile.TemporaryDirectory() as tmp:
        url, manifest = _saved(tmp)
        other = f"{tmp}/other"
        g = torch.Generator().manual_seed(data.draw(st.integers(1, 2**16)))
        save_state_dict({"embed.weight": torch.randn(7, 5, generator=g)}, other)
        shard = data.draw(st.sampled_from(sorted(manifest["shards"])))
        stranger = next(iter(json.loads(Path(f"{other}/stagesafe.json").read_text())["shards"]))
        (Path(url) / shard).write_bytes(Path(f"{other}/{stranger}").read_bytes())
        for reader in (verify, load_state_dict):
            with pytest.raises(HandoffCorruptError, match=f"shard {shard!r}"):
                reader(url)
