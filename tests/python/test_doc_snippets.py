"""The README's and the user guide's code runs as written, and does what its text says.

Every fenced ``python`` block of README.md and docs/guide/*.md is a complete program unless the
line above it is ``<!-- snippet: fragment -->``. Each complete one runs under ``torchrun`` with
2 Gloo ranks on CPU, in a fresh folder, and its output is checked against what the page claims
(``CHECKS``, keyed by the block's ``<!-- snippet: NAME -->``): replicas agree, a resume
continues bit for bit, a hook compresses. The C++ quick start (``<!-- snippet: cpp FILE -->`` and
``<!-- snippet: cmake FILE -->``) is built against the installed package and run the same way;
the C++ fragments are compiled, each inside a function that declares the names it takes from
the program around it.
Links between the pages, and the headings they point at, must exist.
"""
import os
import re
import shutil
import subprocess
import sys
import warnings
from typing import Callable, Dict, List, NamedTuple

import pytest

import ddpx
import torch_compat as tc
from dist_utils import build_cmake_project

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GUIDE = os.path.join(REPO, "docs", "guide")
PAGES = [os.path.join(REPO, "README.md")] + sorted(
    os.path.join(GUIDE, f) for f in os.listdir(GUIDE) if f.endswith(".md"))
MARKER = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->$")


class Block(NamedTuple):
    page: str      # path relative to the repository
    line: int      # line of the opening fence
    lang: str      # first word of the info string
    marker: str    # the <!-- snippet: ... --> text above it, "" if none
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}" + (f"[{self.marker}]" if self.marker else "")


def blocks_of(path: str) -> List[Block]:
    out, lines = [], open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        out.append(Block(os.path.relpath(path, REPO), start + 1, lang,
                         marker.group(1) if marker else "", "\n".join(lines[start + 1:j]) + "\n"))
        i = j + 1
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks_of(page)]
PYTHON = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]
RUNNABLE = [b for b in PYTHON if b.marker != "fragment"]


def _lines(out: str, pattern: str) -> List[re.Match]:
    # Over the whole output, not line by line: the ranks' prints can share a line.
    return list(re.finditer(pattern, out))


def _each_rank(pattern: str) -> Callable[[str, str], None]:
    """Every rank prints a line matching ``pattern`` (which has a ``{rank}`` placeholder)."""
    def check(out: str, folder: str) -> None:
        for rank in (0, 1):
            assert _lines(out, pattern.format(rank=rank)), (pattern, rank)
    return check


def _quickstart(out: str, folder: str) -> None:
    found = {int(m.group(1)): (m.group(2), float(m.group(3))) for m in _lines(
        out, r"rank (\d): weights checksum (\S+), PowerSGD compression ([\d.]+)x")}
    assert sorted(found) == [0, 1], out
    assert found[0][0] == found[1][0], f"the replicas differ: {found}"
    assert found[0][1] > 1.5, f"PowerSGD did not compress: {found}"


def _powersgd(out: str, folder: str) -> None:
    _each_rank(r"rank {rank}: resumed run bit for bit the same: True")(out, folder)
    for rank in (0, 1):  # one checkpoint per rank: each rank's memories are its own
        assert os.path.exists(os.path.join(folder, f"powersgd_rank{rank}.pt"))


def _hook_type(out: str, folder: str) -> None:
    for rank in (0, 1):
        pattern = rf"rank {rank}: (\w+): ddpx's weights differ from torch's by (\d\.\de[+-]\d+)"
        diffs = {m.group(1): float(m.group(2)) for m in _lines(out, pattern)}
        assert sorted(diffs) == ["ALLREDUCE", "FP16_COMPRESS", "POWER_SGD"], (rank, out)
        assert diffs["ALLREDUCE"] == diffs["POWER_SGD"] == 0.0, diffs  # bit for bit
        assert 0 < diffs["FP16_COMPRESS"] < 1e-3, diffs  # fp16 rounding


def _quantized(out: str, folder: str) -> None:
    """Every replica holds the same bits; 8 and 4 bits end at allreduce's solution, 1 bit near."""
    for rank in (0, 1):
        pattern = (rf"rank {rank}: (\d)-bit weights within (\d\.\de[+-]\d+) of allreduce's, "
                   r"replicas identical: (True|False)")
        found = {int(m.group(1)): (float(m.group(2)), m.group(3)) for m in _lines(out, pattern)}
        assert sorted(found) == [1, 4, 8], (rank, out)
        assert all(same == "True" for _, same in found.values()), found
        assert found[8][0] < 1e-3 and found[4][0] < 1e-3 and found[1][0] < 0.2, found


CHECKS: Dict[str, Callable[[str, str], None]] = {
    "quickstart": _quickstart,
    "comm-hooks": lambda out, folder: [
        _each_rank(rf"rank {{rank}}: {dtype} mean within \S+ of the exact mean")(out, folder)
        for dtype in ("fp16", "bf16")],
    "comm-hook-type": _hook_type,
    "quantized": _quantized,
    "powersgd-resume": _powersgd,
    "post-local-sgd": _each_rank(r"rank {rank}: replicas equal after the averaging step: True"),
    "hierarchical": _each_rank(r"rank {rank}: averaged with every rank at steps 0 and 4"),
    "zero-resume": _each_rank(r"rank {rank}: resumed run bit for bit the same: True"),
    "diloco": _each_rank(r"rank {rank}: replicas identical after the synchronization: True, "
                         r"\d+ bytes of outer gradients sent, 6[0-3]x fewer"),
    "dist-optim": lambda out, folder: _lines(
        out, r"C\+\+ steps on the owner: True; its weights changed: True") or pytest.fail(out),
}


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    # An exit-time abort prints every thread's stack (see ddpx/__init__.py).
    env["DDPX_STACKS_ON_ABORT"] = "1"
    # The ddpx under test, also when it is a build tree on sys.path rather than installed.
    ddpx_root = os.path.dirname(os.path.dirname(os.path.abspath(ddpx.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ddpx_root, env.get("PYTHONPATH")) if p)
    return env


def _torchrun(args: List[str], cwd: str, timeout: float = 300) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *tc.TORCHRUN_WORKAROUND_ARGS, *args]
    for attempt in (1, 2):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                             cwd=cwd)
        out = res.stdout + res.stderr
        # torch's Gloo exit race (torch_compat.gloo_exit_race) is not the snippet's fault: one
        # rerun, which must pass whole.
        if res.returncode == 0 or attempt == 2 or not tc.gloo_exit_race(out):
            break
        warnings.warn(f"{args}: torch's Gloo exit race; running again", stacklevel=2)
    assert res.returncode == 0, out[-4000:]
    return out


def test_gloo_exit_race_is_recognised_by_its_aborting_thread():
    worker = ("SIGABRT(6), PID: 7, Thread 9: \n frame #13: pthread_exit + 0x36\n"
              "frame #24: c10d::ProcessGroupGloo::runLoop(int) + 0x11f\n")
    idle = ("SIGABRT(6), PID: 7, Thread 8: \n frame #3: pthread_cond_wait + 0x1e8\n"
            "frame #5: c10d::ProcessGroupGloo::runLoop(int) + 0x531\n")
    main = "SIGABRT(6), PID: 7, Thread 7: \n frame #8: __libc_start_main + 0x85\n"
    terminate = "terminate called without an active exception\n"
    assert tc.gloo_exit_race(terminate + main + idle + worker)
    # An idle worker beside another thread's abort, or no terminate at all, is something else.
    assert not tc.gloo_exit_race(terminate + main + idle)
    assert not tc.gloo_exit_race(main + worker)


def test_every_python_block_is_a_program_or_a_marked_fragment():
    """A fragment says so in its first line too, so that a reader knows it will not run alone."""
    assert len(RUNNABLE) >= 7, [b.id for b in RUNNABLE]
    for b in PYTHON:
        if b.marker == "fragment":
            assert b.code.lstrip().lower().startswith("# fragment"), b.id
        else:
            assert b.marker in CHECKS, f"{b.id}: add a check of what the text says it does"
    assert sorted(b.marker for b in RUNNABLE) == sorted(CHECKS), "each check has one program"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_python_snippet_runs_and_does_what_the_text_says(block: Block, tmp_path):
    (tmp_path / "snippet.py").write_text(block.code)
    out = _torchrun(["snippet.py"], cwd=str(tmp_path))
    CHECKS[block.marker](out, str(tmp_path))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str) -> set:
    out, fenced = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_links_between_pages_resolve():
    bad = []
    for page in PAGES:
        text = open(page, encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full):
                bad.append(f"{os.path.relpath(page, REPO)}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                bad.append(f"{os.path.relpath(page, REPO)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_the_test_index_names_every_test_file():
    """tests/python/README.md is how a contributor finds the test of a feature."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        index = f.read()
    missing = sorted(n for n in os.listdir(HERE)
                     if n.startswith("test_") and n.endswith(".py") and f"`{n}`" not in index)
    assert not missing, f"add to tests/python/README.md: {missing}"


def test_readme_fits_a_product_page():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    assert len(lines) <= 210, len(lines)
    first_screen = "\n".join(lines[:40])
    assert "./scripts/main.sh" in first_screen and "./scripts/test.sh" in first_screen
    assert "git clone" in "\n".join(lines[:60])


def _cpp_files() -> Dict[str, str]:
    files = {}
    for b in blocks_of(os.path.join(REPO, "README.md")):
        m = re.match(r"(cpp|cmake) (\S+)$", b.marker)
        if m:
            files[m.group(2)] = b.code
    return files


PREFIX = ddpx.cmake_prefix_path
_CONFIG = os.path.join(PREFIX, "lib", "cmake", "ddpx", "ddpxConfig.cmake")


@pytest.mark.skipif(not os.path.exists(_CONFIG),
                    reason=f"ddpx at {PREFIX} is not a pip-installed package (no lib/cmake/ddpx)")
@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
def test_cpp_quick_start_builds_and_trains(tmp_path):
    files = _cpp_files()
    assert sorted(files) == ["CMakeLists.txt", "train.cpp"], sorted(files)
    src = tmp_path / "src"
    src.mkdir()
    for name, code in files.items():
        (src / name).write_text(code)
    build = tmp_path / "build"
    build_cmake_project(src, build, PREFIX)
    out = _torchrun(["--no_python", str(build / "train")], cwd=str(tmp_path))
    rates = [float(m.group(2)) for m in _lines(out, r"rank (\d): PowerSGD compression ([\d.]+)x")]
    assert len(rates) == 2 and min(rates) > 1.5, out[-3000:]


# The names the C++ fragments take from the program around them ("pg and ddp as above"): declared
# in an outer scope, so that a fragment that declares one itself shadows it in its own block.
_CPP_FRAGMENT_PRELUDE = """\
#include <ddpx/ddp.h>
#include <ddpx/hooks.h>
#include <ddpx/optim/averagers.h>
#include <ddpx/optim/diloco.h>
#include <ddpx/optim/post_localsgd_optimizer.h>
#include <ddpx/optim/zero.h>
#include <torch/torch.h>

#include <memory>
"""


def _cpp_fragment_function(index: int, block: Block) -> str:
    return f"""
// {block.page}:{block.line}
[[maybe_unused]] static void fragment_{index}() {{
  [[maybe_unused]] auto pg = ddpx::ddp::init_process_group_from_env("gloo");
  [[maybe_unused]] decltype(pg) subgroup;
  torch::nn::Sequential net(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                            torch::nn::Linear(256, 10));
  [[maybe_unused]] ddpx::ddp::DistributedDataParallel ddp(net, pg);
  [[maybe_unused]] auto state =
      std::make_shared<ddpx::hooks::PowerSGDState>(pg, ddpx::hooks::PowerSGDOptions{{}});
  [[maybe_unused]] auto x = torch::randn({{8, 64}});
  [[maybe_unused]] auto y = torch::randint(0, 10, {{8}}, torch::kLong);
  {{
#line {block.line + 1} "{block.page}"
{block.code}  }}
}}
"""


CPP_FRAGMENTS = [b for b in ALL_BLOCKS if b.lang == "cpp" and b.marker == "fragment"]


@pytest.mark.skipif(not os.path.exists(_CONFIG),
                    reason=f"ddpx at {PREFIX} is not a pip-installed package (no lib/cmake/ddpx)")
@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
def test_cpp_fragments_compile(tmp_path):
    """Every C++ block marked as a fragment compiles against the installed package, inside a
    function that declares what the guide says it takes from around it (pg, net, ddp, state,
    subgroup, x, y). Compiled, not run: they are pieces of the README's program, which the test
    above builds and runs; this keeps their names and signatures true to the headers."""
    assert len(CPP_FRAGMENTS) >= 3, [f"{b.page}:{b.line}" for b in CPP_FRAGMENTS]
    src = tmp_path / "src"
    src.mkdir()
    (src / "fragments.cpp").write_text(
        _CPP_FRAGMENT_PRELUDE + "".join(_cpp_fragment_function(i, b)
                                        for i, b in enumerate(CPP_FRAGMENTS)))
    # An object library: compiled with the flags a user's target gets, nothing linked.
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\n"
        "project(fragments LANGUAGES CXX)\n"
        "find_package(ddpx REQUIRED)\n"
        "add_library(fragments OBJECT fragments.cpp)\n"
        "target_link_libraries(fragments PRIVATE ddpx::ddpx)\n")
    build_cmake_project(src, tmp_path / "build", PREFIX)
