"""Every code snippet of README.md and docs/ runs, as a reader would run it.

Each ```python or ```bash fence is preceded by a marker comment, ``<!-- snippet: KIND [ARGS] -->``, that says
how it runs (a test fails for a fence without one):

- ``python``: as it is, in a fresh interpreter in an empty folder.
- ``python-with NAME``: after the prelude NAME below (it defines the names the snippet takes as given, such as
  ``model`` or ``sd``).
- ``lightning``: a Trainer script after the ``trainer`` prelude, run as Lightning runs it (rank 1 starts by
  re-running the script), on 2 CPU processes: ``accelerator="gpu"`` becomes ``"cpu"`` and ``devices=N``
  becomes ``devices=2``, the only changes made to the text; the prelude's Trainer stops after 2 steps.
- ``s3``: after the ``model`` prelude, against the test S3 server: ``s3://my-bucket`` and the line
  ``opts = {...}`` point at it.
- ``shell``: each command line in bash from the repository's root; ``shell-short`` gives a long command a short
  budget (``900`` seconds becomes ``5``). A ``pytest`` command is not run (this suite runs those tests): the
  files and tests it names must exist.
- ``covered-by TEST ...``: commands another test, or CI itself (``.ci/run``), runs; the test must exist.
Printed output shown in a ``text`` fence right after a snippet, under a ``<!-- output -->`` marker, must
appear in what the snippet prints (each non-empty line, numbers aside).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from _launch import run_script, sanitized_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
_FENCE = re.compile(
    r"(?:^[ \t]*<!-- snippet: (?P<kind>[^>]*?) -->\n)?^(?P<indent>[ \t]*)```(?P<lang>python|bash)\n(?P<body>.*?)^(?P=indent)```\n"
    r"(?:\n?^[ \t]*<!-- output -->\n^[ \t]*```text\n(?P<output>.*?)^[ \t]*```\n)?",
    re.M | re.S,
)

PRELUDES = {
    "model": '''
        import torch
        from torch import nn

        class MyLightningModule(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(8, 4)

        model = MyLightningModule()
    ''',
    "state": '''
        import os
        import torch
        sd = {"layer.weight": torch.randn(4, 8), "layer.bias": torch.zeros(4)}
        url = os.path.abspath("weights")
        opts = None
    ''',
    "handoff": '''
        import torch
        import lightning.pytorch as pl
        import stagesafe
        from torch import nn

        class MyLightningModule(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(8, 4)

        stagesafe.save_state_dict(MyLightningModule().state_dict(), "stagesafe_handoff")  # as a Trainer call leaves it
    ''',
    "trainer": '''
        import torch
        import lightning.pytorch as pl
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        class MyLightningModule(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(8, 4)

            def forward(self, x):
                return self.layer(x)

            def training_step(self, batch, batch_idx):
                return self(batch[0]).float().pow(2).mean()

            def validation_step(self, batch, batch_idx):
                self.log("val", self(batch[0]).float().mean(), sync_dist=True)

            test_step = validation_step

            def predict_step(self, batch, batch_idx):
                return self(batch[0])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        def _loader():
            return DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)

        torch.manual_seed(0)
        model = MyLightningModule()
        train_loader = val_loader = test_loader = predict_loader = _loader()
        _Trainer = pl.Trainer
        pl.Trainer = lambda **kwargs: _Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                                                enable_progress_bar=False, **kwargs)  # a short run
    ''',
    "hf": '''
        import torch
        import stagesafe
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)
        handoff_uri = "handoff"
        torch.manual_seed(0)
        _state = LlamaForCausalLM(config).state_dict()
        stagesafe.save_state_dict({"model." + k: v for k, v in _state.items()}, handoff_uri)  # a LightningModule's names
    ''',
}


@dataclass
class Snippet:
    where: str  # file:line
    kind: str
    lang: str
    body: str
    output: str | None


def _snippets() -> list[Snippet]:
    found = []
    for name in FILES:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            text = f.read()
        for m in _FENCE.finditer(text):
            line = text[: m.start("indent")].count("\n") + 1
            body = textwrap.dedent("\n".join(l[len(m.group("indent")) :] for l in m.group("body").splitlines()))
            found.append(Snippet(f"{name}:{line}", (m.group("kind") or "").strip(), m.group("lang"), body,
                                 m.group("output")))
    return found


SNIPPETS = _snippets()


def test_every_snippet_says_how_it_runs():
    unmarked = [s.where for s in SNIPPETS if not s.kind]
    assert not unmarked, f"fences without a <!-- snippet: ... --> marker: {unmarked}"
    counted = sum(len(re.findall(r"^[ \t]*```(?:python|bash)\n", open(os.path.join(ROOT, f)).read(), re.M)) for f in FILES)
    assert counted == len(SNIPPETS), "a python/bash fence the snippet parser did not see"


def _python_source(snippet: Snippet, prelude: str | None) -> str:
    parts = [textwrap.dedent(PRELUDES[prelude]) if prelude else "", snippet.body]
    return "\n".join(parts)


def _run_python(source: str, tmp_path, env: dict | None = None) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(source)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                            env=sanitized_env(env))
    assert result.returncode == 0, f"{source}\n--- stderr:\n{result.stderr[-4000:]}"
    return result.stdout


def _check_output(snippet: Snippet, printed: str) -> None:
    if snippet.output is None:
        return
    number = re.compile(r"\d+(?:\.\d+)?")
    seen = {number.sub("N", line.strip()) for line in printed.splitlines()}
    for line in snippet.output.splitlines():
        if line.strip():
            assert number.sub("N", line.strip()) in seen, f"{snippet.where}: the doc shows {line!r}, not printed"


_LIGHTNING_JOB = """
import os
import lightning.pytorch as pl

ROOT = os.path.dirname(os.path.abspath(__file__))  # rank 1 re-runs this script from the folder rank 0 was in
_Trainer = pl.Trainer
for number, (where, source) in enumerate(SNIPPETS):
    folder = os.path.join(ROOT, f"snippet{number}")
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    pl.Trainer = _Trainer  # each snippet's prelude wraps the real Trainer
    exec(compile(source, where, "exec"), {"__name__": "__main__"})
    print(f"=== done {where}", flush=True)
"""


@pytest.fixture(scope="module")
def lightning_snippets(tmp_path_factory) -> str:
    """Every ``lightning`` snippet, one after the other in one 2-process job (as one script that runs several
    Trainers would), each in a folder of its own: one job's start-up instead of one per snippet."""
    sources = []
    for snippet in (s for s in SNIPPETS if s.kind == "lightning"):
        body = re.sub(r'accelerator="gpu"', 'accelerator="cpu"', snippet.body)
        body = re.sub(r"devices=\d+", "devices=2", body)
        sources.append((snippet.where, _python_source(Snippet(snippet.where, "lightning", snippet.lang, body, None),
                                                      "trainer")))
    folder = tmp_path_factory.mktemp("lightning-snippets")
    script = folder / "snippets.py"
    script.write_text(f"SNIPPETS = {sources!r}\n{_LIGHTNING_JOB}")
    return run_script(str(script), timeout=300, cwd=str(folder)).stdout


def _check_test_targets(where: str, targets: list[str]) -> None:
    """Each ``path`` or ``path::test`` names a file of this repository, and a test defined in it."""
    for target in targets:
        assert not target.startswith("-"), f"{where}: {target!r}: the docs' pytest commands take paths only"
        path = target.split("::")[0]
        assert os.path.isfile(os.path.join(ROOT, path)), f"{where}: {path} does not exist"
        if "::" in target:
            assert f"def {target.split('::')[1]}(" in open(os.path.join(ROOT, path)).read(), f"{where}: {target}"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet, tmp_path, request):
    kind, *args = snippet.kind.split()
    if kind == "python":
        _check_output(snippet, _run_python(snippet.body, tmp_path))
    elif kind == "python-with":
        _check_output(snippet, _run_python(_python_source(snippet, args[0]), tmp_path))
    elif kind == "lightning":
        printed = request.getfixturevalue("lightning_snippets")
        assert f"=== done {snippet.where}" in printed, f"{snippet.where} did not run to its end:\n{printed[-2000:]}"
    elif kind == "s3":
        s3 = request.getfixturevalue("s3")
        bucket = s3.new_url("snippet").rsplit("/", 1)[0]
        body = snippet.body.replace("s3://my-bucket", bucket)
        body = re.sub(r"^opts = \{.*\}.*$", f"opts = {json.dumps(s3.storage_options())}", body, flags=re.M)
        _run_python(_python_source(Snippet(snippet.where, kind, snippet.lang, body, None), "model"), tmp_path)
    elif kind in ("shell", "shell-short"):
        for command in [c for c in snippet.body.replace("\\\n", " ").splitlines() if c.strip()]:
            command = command.split("#", 1)[0].strip()
            if kind == "shell-short":
                command = re.sub(r"\b900\b", "5", command)
            if command.startswith("pytest "):  # this suite runs those tests itself: check that they exist
                _check_test_targets(snippet.where, shlex.split(command)[1:])
                continue
            env = sanitized_env({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
            result = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=350,
                                    env=env)
            assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    elif kind == "covered-by":
        _check_test_targets(snippet.where, args)
    else:
        pytest.fail(f"{snippet.where}: unknown snippet kind {kind!r}")
