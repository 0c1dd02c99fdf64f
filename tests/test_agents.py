"""The inner loop's parts without a full run: validation annotations and their expansion, the
static scans the judge adds (each planted and rejected), DESIGN.md as planning state, the offline
planner's mapping of hints to skills, and the sandbox's isolation."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from agents.offline.evaluator import concurrency_shares, hints_from
from agents.offline.judge import OfflineJudge
from agents.offline.planner import OfflinePlanner
from agents.roles import Hint, Task
from skills.design_doc import DesignDoc, Step
from skills.library import load_skills
from skills.starter import write_starter
from skills.validation import AnnotationError, expand_source, unexpanded
from targets.api import TraceEvent
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox, scrubbed_environment
from targets.harness.judge import integrity
from targets.harness.judge.integrity import scan_stack
from targets.harness.measure.session import Session
from targets.harness.target import Target
from targets.spec import load_target

# -- validation annotations --------------------------------------------------------------------


def _run(source: str, call: str, **names):
    namespace: dict = {}
    exec(expand_source(source)[0], namespace)
    return eval(call, namespace, names)


def test_each_pattern_expands_into_a_check_with_a_message_naming_the_value():
    source = """
def f(xs, n, chosen):
    # VAL: VAL_INT_RANGE (min=0, max=len(xs))
    k = n
    # VAL: VAL_NON_EMPTY (value=xs)
    # VAL: VAL_SUBSET (value=chosen, of=xs)
    # VAL: AST_PRECONDITION (cond=k >= 0)
    out = xs[:k]
    # VAL: AST_POSTCONDITION (cond=len(out) == k)
    return out
"""
    assert _run(source, "f([1, 2, 3], 2, [1])") == [1, 2]
    with pytest.raises(ValueError, match=r"k must be an int in \[0, len\(xs\)\] = \[0, 3\], got 7"):
        _run(source, "f([1, 2, 3], 7, [1])")
    with pytest.raises(ValueError, match=r"k must be an int .*, got True"):  # a bool is an int to Python, no count
        _run(source, "f([1, 2, 3], True, [1])")
    with pytest.raises(ValueError, match="xs must not be empty, got \\[\\]"):
        _run(source, "f([], 0, [])")
    with pytest.raises(ValueError, match="chosen must be a subset of xs = \\[1, 2, 3\\]; not in it: \\[9\\]"):
        _run(source, "f([1, 2, 3], 1, [9])")


def test_a_check_over_ten_lines_becomes_a_named_function():
    expanded, count = expand_source("def g(ids):\n    # VAL: VAL_NO_DUPLICATES (value=ids)\n    return ids\n")
    assert count == 1 and "def _validate_val_no_duplicates_1(ids)" in expanded
    namespace: dict = {}
    exec(expanded, namespace)
    with pytest.raises(ValueError, match=r"ids must not repeat elements: 'a' x2 at \[0, 2\]"):
        namespace["g"](["a", "b", "a"])


def test_bad_annotations_are_named():
    with pytest.raises(AnnotationError, match="<source>:1: unknown pattern VAL_PRIME"):
        expand_source("# VAL: VAL_PRIME (value=x)\n")
    with pytest.raises(AnnotationError, match="missing \\['max'\\]"):
        expand_source("# VAL: VAL_INT_RANGE (value=x, min=0)\n")
    with pytest.raises(AnnotationError, match="next line is not a simple assignment"):
        expand_source("# VAL: VAL_NON_EMPTY ()\nprint(1)\n")
    with pytest.raises(AnnotationError, match="malformed annotation"):
        expand_source("# VAL: VAL_NON_EMPTY value=x\n")


def test_the_recipes_carry_annotations_and_starters_carry_none(tmp_path, tiny_spec):
    recipes = Path(__file__).parents[1] / "skills" / "recipes"
    assert len(unexpanded(recipes)) >= 5
    stack = write_starter(tmp_path / "s", tiny_spec, "time_multiplex")
    assert unexpanded(stack / "stack") == []
    assert "# VAL expanded: VAL_INT_RANGE" in (stack / "stack" / "time_multiplex.py").read_text()


def test_an_expanded_check_names_its_file_as_the_stack_does_so_rounds_diff_only_what_changed(tmp_path, tiny_spec):
    """Each round works in its own worktree: a check naming the worktree's absolute path changed in every
    round's diff though nothing else in the module did."""
    from agents.offline.implementer import OfflineImplementer

    first = write_starter(tmp_path / "round-1", tiny_spec, "colocate")
    second = write_starter(tmp_path / "round-2", tiny_spec, "colocate")
    task = Task(id="env", title="refresh the manager", rationale="the library's is newer", skills=["env_manager"])
    for workspace in (first, second):
        OfflineImplementer(tiny_spec, OfflinePlanner(tiny_spec)).implement(task, workspace, [])
    text = (first / "stack" / "env_manager.py").read_text()
    assert "from stack/env_manager.py:" in text and str(tmp_path) not in text
    assert text == (second / "stack" / "env_manager.py").read_text()


def test_the_offline_implementer_brings_the_recipes_a_refreshed_module_imports(tmp_path, tiny_spec):
    """A run resumed on a stack written before ``rendezvous.py`` existed: refreshing ``fsdp_trainer.py``
    alone left it importing a module the stack lacked, and the attempt failed on an ImportError."""
    from agents.offline.implementer import OfflineImplementer
    from agents.roles import Task

    workspace = write_starter(tmp_path / "w", tiny_spec, "colocate")
    stack = workspace / "stack"
    current = (stack / "rendezvous.py").read_text()
    (stack / "rendezvous.py").unlink()  # the stack predates the recipe
    task = Task(id="trainer", title="refresh the trainer", rationale="the library's is newer", skills=["fsdp_trainer"])
    attempt = OfflineImplementer(tiny_spec, OfflinePlanner(tiny_spec)).implement(task, workspace, [])
    assert (stack / "rendezvous.py").read_text() == current
    assert "stack/rendezvous.py" in attempt.files_changed
    assert "stack/fsdp_trainer.py" not in attempt.files_changed  # refreshed, but no different from the library's


def test_the_offline_implementer_says_when_its_repair_would_change_nothing(tmp_path, tiny_spec):
    """Its one repair after a rejection is the library's recipes and the task's parameters again: where
    the candidate already is that (a technique the selection net rejects by design, a twin that fails it),
    the second attempt was the same candidate judged again, on a real GPU target a whole check for the
    same verdict. It now says so; where a recipe was edited, it restores it and goes on."""
    from agents.offline.implementer import OfflineImplementer
    from agents.roles import NothingToRepair, Task, starter_task

    workspace = write_starter(tmp_path / "w", tiny_spec, "time_multiplex")
    implementer = OfflineImplementer(tiny_spec, OfflinePlanner(tiny_spec))
    spares = {"redundant_envs": 2}
    task = Task(id="spares", title="add spares", rationale="tails", skills=["redundant_envs"], changes=spares)
    implementer.implement(task, workspace, [])
    rejected = ["system_audit: selection: the episodes trained are 32% shorter ..."]
    with pytest.raises(NothingToRepair, match="the judge would see the candidate it just rejected"):
        implementer.implement(task, workspace, rejected)
    engine = workspace / "stack" / "paged_engine.py"
    library = engine.read_text()
    engine.write_text(library + "\nBROKEN = True\n")  # what an earlier attempt could have left
    attempt = implementer.implement(task, workspace, rejected)
    assert engine.read_text() == library and "stack/paged_engine.py" in attempt.files_changed
    # a starter is the library's every time: a rejected one written again would be the same
    starter, first = starter_task("colocate"), tmp_path / "round-0"
    implementer.implement(starter, first, [])
    with pytest.raises(NothingToRepair, match="the starter is written from the library"):
        implementer.implement(starter, first, rejected)


def test_the_judge_rejects_an_unexpanded_annotation_without_running_it(tmp_path, tiny_spec):
    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    path = stack / "stack" / "static_split.py"
    path.write_text(
        path.read_text().replace(
            "        rollout, train = self.placement(cluster.devices)",
            "        # VAL: VAL_NON_EMPTY (value=envs)\n        rollout, train = self.placement(cluster.devices)",
        )
    )
    judge = OfflineJudge(Session(Target.load("tiny-qwen3-cpu"), Sandbox("subprocess"), Limits(time_s=5)))
    verdict = judge.judge(stack, tmp_path / "out")
    assert not verdict.passed and verdict.run is None
    assert any("unexpanded validation annotation: stack/static_split.py" in r for r in verdict.reasons)


# -- integrity scans, each planted ---------------------------------------------------------------

PLANTS = {
    "patches the clock": "import time\ntime.monotonic = lambda: 0.0\n",
    "patches the clock (setattr on asyncio)": "import asyncio\nsetattr(asyncio, 'sleep', None)\n",
    "reaches into a harness object (._calls)": "def f(episode):\n    return episode._calls.channel\n",
    "reaches into a harness object (._memory)": "def f(self):\n    return self.cluster._memory\n",
    "reaches into a harness object (._call)": "async def f(cluster):\n    await cluster._call('train')\n",
    # a review's (session CD): ``self`` is whatever a function is handed, a proxy too
    "reaches into a harness object (._calls, on a parameter named self)": (
        "def peek(self):\n    return self._calls.channel\n"
    ),
    "reaches into a harness object (._memory, on a name bound to self)": "self = object()\nself._memory\n",
    "uses .__getstate__, an introspection escape hatch": "def f(cluster):\n    return cluster.__getstate__()\n",
    "uses .__reduce_ex__, an introspection escape hatch": "def f(cluster):\n    return cluster.__reduce_ex__(2)[2]\n",
    "imports gc, an introspection escape hatch": "import gc\n",
    "uses .__globals__, an introspection escape hatch": "def f(g):\n    return g.__globals__\n",
    "uses .modules, an introspection escape hatch": "import sys\nsys.modules['time'] = None\n",
    # the same, through another name or by a call: the scan follows what a name is bound to
    "patches the clock (t.monotonic)": "import time as t\nt.monotonic = lambda: 0.0\n",
    "patches the clock (setattr on aio)": "import asyncio as aio\nsetattr(aio, 'sleep', None)\n",
    "patches the clock (a submodule)": "import asyncio.events as ev\nev.get_event_loop = None\n",
    # every statement that rebinds or removes a module attribute, not only a plain assignment
    "patches the clock (del)": "import time\ndel time.perf_counter\n",
    "patches the clock (augmented)": "import time\ntime.monotonic += 0\n",
    "patches the clock (annotated)": "import time\ntime.time: object = lambda: 0.0\n",
    "patches the clock (delattr on time)": "import time\ndelattr(time, 'monotonic')\n",
    "uses .modules, an introspection escape hatch (aliased)": "import sys as s\ns.modules.pop('time')\n",
    "imports sys.modules, an introspection escape hatch": "from sys import modules\nmodules.pop('time')\n",
    "imports gc, an introspection escape hatch (by __import__)": "__import__('gc').get_objects()\n",
    "imports gc, an introspection escape hatch (by importlib)": "import importlib\nimportlib.import_module('gc')\n",
    "imports harness internals (by import_module)": (
        "from importlib import import_module as im\nim('targets.harness.trace')\n"
    ),
    "imports a module by a computed name": "import importlib, os\nimportlib.import_module(os.environ['M'])\n",
    "imports gc, an introspection escape hatch (its name in constant pieces)": (
        "import importlib\nimportlib.import_module('g' + 'c')\n"
    ),
    # the package's own names: every harness module the candidate process loaded is an attribute of it
    "imports harness internals (from targets import)": "from targets import harness\n",
    "imports harness internals (the package)": "import targets\n",
    "imports harness internals (the package by importlib)": "import importlib\nimportlib.import_module('targets')\n",
    "imports harness internals (through targets.api's name)": "import targets.api\ntargets.harness.trace\n",
    "imports harness internals (off __import__)": "__import__('targets.api').harness\n",
    "imports harness internals (a fromlist)": "__import__('targets', fromlist=['harness'])\n",
    # an attribute by its name is the attribute
    "reaches into a harness object (by getattr)": "def f(cluster):\n    return getattr(cluster, '_calls')\n",
    "uses .__globals__, an introspection escape hatch (getattr)": "def f(g):\n    return getattr(g, '__globals__')\n",
    "uses .modules, an introspection escape hatch (by getattr on sys)": "import sys\ngetattr(sys, 'modules')\n",
    # code the scan cannot read, and the other ways to an object's insides
    "runs code by exec()": "exec('import gc')\n",
    "runs code by eval()": "eval(\"__import__('gc')\")\n",
    "runs code by compile()": "code = compile('import gc', 'planted', 'exec')\n",
    "uses vars(), an introspection escape hatch": "def f(cluster):\n    return vars(cluster)['inner']\n",
    "uses .__getattribute__, an introspection escape hatch": (
        "def f(cluster):\n    return object.__getattribute__(cluster, 'inner')\n"
    ),
    "reaches into a harness object (attrgetter)": "import operator\nCALLS = operator.attrgetter('_calls')\n",
    "imports builtins, an introspection escape hatch": "import builtins\nbuiltins.__import__('gc')\n",
    "uses __builtins__, an introspection escape hatch": "GC = __builtins__['__import__']('gc')\n",
    "imports runpy, an introspection escape hatch": "import runpy\nrunpy.run_module('gc')\n",
    "loads a module from a file (.spec_from_file_location)": (
        "import importlib.util\nSPEC = importlib.util.spec_from_file_location('t', 'targets/harness/trace.py')\n"
    ),
    "uses .f_globals, an introspection escape hatch": "import sys\nCALLER = sys._getframe(1).f_globals\n",
    "uses .f_back, an introspection escape hatch": "def f(frame):\n    return frame.f_back\n",
    "uses .__subclasses__, an introspection escape hatch": "EVERY_CLASS = object.__subclasses__()\n",
    "syntax error": "def f(:\n    pass\n",  # a file the scan cannot read is refused, not skipped
    "defines or uses 'goodput'": "goodput = 0.9\n",
    # a red team's (session BW): each passed the scan and reached what it refuses, in a plain process
    "imports a module relative to a package (import_module)": (
        "import importlib\nT = importlib.import_module('.harness.trace', 'targets')\n"
    ),
    "imports a module relative to a package (__import__)": "H = __import__('harness.clock', {}, None, ['x'], 1)\n",
    "hands .import_module on as a value": "import importlib\nload = importlib.import_module\nGC = load('gc')\n",
    "hands the time module on as a value": "import time\nclock = time\nclock.monotonic = lambda: 0.0\n",
    "calls setattr with unpacked arguments": "import time\nsetattr(*(time, 'monotonic', lambda: 42.0))\n",
    "imports os.sys, an introspection escape hatch": "from os import sys as s\nMODULES = s.modules\n",
    "uses .sys, an introspection escape hatch": "import os\nMODULES = os.sys.modules\n",
    "imports _ctypes, an introspection escape hatch": "import _ctypes\nSAME = _ctypes.PyObj_FromPtr(id(object))\n",
    "runs code by exec() (a method of that name elsewhere)": (
        "class Decoy:\n    def exec(self):\n        pass\n\nexec('import gc')\n"
    ),
    "hands eval on as a value": "run = eval\nrun('1 + 1')\n",
    "names '__builtins__', an introspection escape hatch": "B = globals()['__builtins__']\n",
    "imports pickle, an introspection escape hatch": (
        "import pickle\nGC = pickle.loads(b'cimportlib\\nimport_module\\n(Vgc\\ntR.')\n"
    ),
    "imports marshal, an introspection escape hatch": "import marshal\nCODE = marshal.loads(b'')\n",
    "uses .FunctionType, an introspection escape hatch": "import types\nF = types.FunctionType(compile, {})\n",
    "changes sys.path": "import sys\nsys.path.insert(0, '/somewhere/targets/harness')\n",
    "uses .setprofile, an introspection escape hatch": "import sys\nsys.setprofile(lambda *a: None)\n",
    "uses .walk_stack, an introspection escape hatch": (
        "import traceback\nFRAME = next(traceback.walk_stack(None))[0]\n"
    ),
    "names 'f_globals', an introspection escape hatch": "def f(frame):\n    return getattr(frame, 'f_' + 'globals')\n",
    "names '__subclasses__', an introspection escape hatch": "ALL = getattr(object, '__sub' + 'classes__')()\n",
    "names the harness metric 'goodput' (a keyword)": "REPORT = dict(goodput=123.0)\n",
    "names the harness metric 'tokens_per_s' (in pieces)": "REPORT = {}\nREPORT['tokens_' + 'per_s'] = 1e9\n",
    "unpickles by torch.load(weights_only=...)": "import torch\nSTATE = torch.load('w.pt', weights_only=False)\n",
    # a second review's (session BW), past the first fixes
    "hands im on as a value": (
        "from importlib import import_module as im\nload = im\nT = load('targets.harness.trace')\n"
    ),
    "runs code by exec() (a nested function's exec)": (
        "def helper():\n    def exec(s):\n        pass\n\nexec('import gc')\n"
    ),
    "runs code by exec() (a def that never runs)": "if False:\n    def exec(s):\n        pass\nexec('import gc')\n",
    "runs code by exec() (a loop over nothing)": "for exec in []:\n    pass\nexec('import gc')\n",
    "patches the clock (a module bound by a call)": "t = __import__('time')\nt.monotonic = lambda: 0.0\n",
    "changes sys.path (from sys import path)": "from sys import path\npath.insert(0, '/somewhere')\n",
    "hands sys.path on as a value": "import sys\nlist.insert(sys.path, 0, '/somewhere')\n",
    "uses __path__": "__path__.append('/somewhere')\n",
    "imports importlib._bootstrap, an introspection escape hatch": "import importlib._bootstrap as boot\n",
    "imports a module loader": "from importlib.machinery import PathFinder\n",
    "reaches into a harness object (getattr of '_calls', in pieces)": "def f(c):\n    getattr(c, '_ca' + 'lls')\n",
    "unpickles by allow_pickle": "import numpy\nX = numpy.load('x.npy', allow_pickle=True)\n",
    "calls load with unpacked keywords": "import torch\nS = torch.load('w.pt', **{'weights_only': False})\n",
    "names TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "import os\nos.environ['TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'] = '1'\n",
    "imports joblib, an introspection escape hatch": "import joblib\n",
    "nested too deep for the scan to read": "X = " + " + ".join(["'a'"] * 1200) + "\n",
    "names the harness metric 'trained_tokens_per_s'": "REPORT = {'trained_tokens_per_s': 1e9}\n",  # a headline too
    # a fifth review's (session CG): a module, a patch or an attribute path by a string; a task's frames
    "imports pydoc, an introspection escape hatch": "import pydoc\nT = pydoc.locate('targets.harness.trace')\n",
    "uses .resolve_name, an introspection escape hatch": (
        "import pkgutil\nT = pkgutil.resolve_name('targets.harness.trace')\n"
    ),
    "imports unittest, an introspection escape hatch": (
        "from unittest import mock\nmock.patch('time.monotonic', lambda: 0.0).start()\n"
    ),
    "uses .Formatter, an introspection escape hatch": (
        "import json, string\nB = string.Formatter().get_field('0.__globals__', (json.dumps,), {})\n"
    ),
    "imports string.Formatter, an introspection escape hatch": (
        "from string import Formatter\nB = Formatter().get_field('0.__globals__', (print,), {})\n"
    ),
    "uses .get_stack, an introspection escape hatch": "import asyncio\nF = asyncio.current_task().get_stack()\n",
    "imports harness internals (getattr on the package)": "import targets.api\nH = getattr(targets, 'harness')\n",
    # a third review's (session CC): a module reached through an import call's result, not a name
    "uses .modules, an introspection escape hatch (on __import__'s result)": "__import__('sys').modules.pop('time')\n",
    "uses .modules, an introspection escape hatch (on import_module's result)": (
        "import importlib\nimportlib.import_module('sys').modules.pop('time')\n"
    ),
    "changes sys.path (on __import__'s result)": "__import__('sys').path.insert(0, '/somewhere/targets/harness')\n",
    "changes sys.path (on import_module's result)": (
        "import importlib\nimportlib.import_module('sys').path.append('/somewhere')\n"
    ),
    "patches the clock (on __import__'s result)": "__import__('time').monotonic = lambda: 0.0\n",
    "patches the clock (setattr on __import__('asyncio'))": "setattr(__import__('asyncio'), 'sleep', None)\n",
}


@pytest.mark.parametrize("reason", list(PLANTS))
def test_integrity_scan_rejects_each_planted_escape(tmp_path, tiny_spec, reason):
    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    assert scan_stack(stack).passed
    (stack / "stack" / "planted.py").write_text(PLANTS[reason])
    result = scan_stack(stack)
    assert not result.passed and any(reason.split(" (")[0] in r and "planted.py" in r for r in result.reasons), (
        result.reasons
    )


@pytest.mark.parametrize("archive", ["lib.zip", "stack/dep.egg", "extra.pth"])
def test_an_archive_python_imports_from_is_refused_unread(tmp_path, tiny_spec, archive):
    """A zip on sys.path imports its modules unscanned (the red team's hid a harness import and a clock patch
    in one): a file Python can import from is refused like compiled code."""
    import zipfile

    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    with zipfile.ZipFile(stack / archive, "w") as bundle:
        bundle.writestr("hidden.py", "import gc\n")
    result = scan_stack(stack)
    assert not result.passed and result.reasons == [
        f"{archive}: an archive Python can import modules from, which the integrity scan does not read"
    ]


def test_a_source_file_too_large_to_parse_safely_is_refused_unread(tmp_path, tiny_spec):
    """Parsed, a Python file takes ~600 times its size in the orchestrator's memory: a 6 MB one an agent
    wrote (``a=1`` a line) took it past 3 GiB in the scan and in the prompt's file map. Over 1 MiB a file is
    refused by the scan unread, and the map says its size."""
    from agents.llm.context import file_map

    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    (stack / "stack" / "big.py").write_text("a = 1\n" * 200_000)  # 1.2 MB
    result = scan_stack(stack)
    assert not result.passed and result.reasons == [
        "stack/big.py: 1200000 bytes of source, over the 1048576 the scan reads"
    ]
    assert [e.about for e in file_map(stack) if e.path == "stack/big.py"] == ["(1200000 bytes: too large to read)"]


def test_a_file_scanned_clean_and_then_edited_is_scanned_again(tmp_path, tiny_spec):
    """The scan keeps each file's findings by its text: an edit to a file it passed is a new text."""
    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    assert scan_stack(stack).passed
    controller = stack / "stack" / "static_split.py"
    controller.write_text(controller.read_text() + "\nimport targets.harness.trace\n")
    result = scan_stack(stack)
    assert not result.passed and any("imports harness internals" in r for r in result.reasons), result.reasons


def test_a_file_that_declares_another_encoding_is_refused(tmp_path, tiny_spec):
    """Python decodes a source file by the encoding it declares: in UTF-7 ``+AAo-`` is a line break, so a
    comment read as UTF-8 is code read as Python reads it. The scan read it as Python does, but the LLM review's
    page and its read_file read UTF-8: a red team's utf_7 line set a flag the review saw as a comment."""
    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    (stack / "stack" / "planted.py").write_bytes(b"# coding: utf_7\nx = 1  # +AAo-import gc\n")
    result = scan_stack(stack)
    assert not result.passed and result.reasons == [
        "stack/planted.py: declares the encoding utf_7: a stack's source is UTF-8, as its reviewers read it (a line "
        "Python decodes as code may read as a comment in another)"
    ]
    (stack / "stack" / "planted.py").write_bytes(b"# -*- coding: ascii -*-\nx = 1\n")  # a subset of UTF-8
    assert scan_stack(stack).passed
    (stack / "stack" / "planted.py").write_bytes(b"x = 1\x00\n")  # Python would not import it either
    assert scan_stack(stack).reasons == ["stack/planted.py: syntax error: source code string cannot contain null bytes"]


LOOKALIKES = {  # what an honest stack writes that only looks like an escape: the scan lets each through
    "torch.compile by its own name": "from torch import compile\nMODEL = compile(lambda x: x)\n",
    "re.compile": "import re\nPATTERN = re.compile('a+')\n",
    "a module's eval mode": "def f(model):\n    return model.eval()\n",
    "a dtype by a computed name": "import torch\ndef f(name):\n    return getattr(torch, name)\n",
    "a module's submodules": "def f(model):\n    return list(model.modules())\n",
    "targets.api by from-import": "from targets import api\nfrom targets.api import Cluster\n",
    "a method named exec, called as a method": (
        "class Runner:\n    def exec(self):\n        return 1\n\nRunner().exec()\n"
    ),
    "the time module's attributes passed on": "import time\nclock = time.monotonic\nSTAMP = clock()\n",
    "a name time that is no module": "def f(time: float) -> float:\n    return time * 2\n",
    "datetime's class by from-import": "from datetime import datetime\nNOW = datetime.now\n",
    "torch.load of weights only": "import torch\nSTATE = torch.load('w.pt', weights_only=True)\n",
    "sys.path read": "import sys\nFIRST = sys.path[0]\n",
    "a parameter named compile": (
        "import torch\ndef build(model, compile: bool = True):\n    return torch.compile(model) if compile else model\n"
    ),
    "a parameter named eval": "def run(loader, eval=False):\n    return [b for b in loader] if eval else []\n",
    "a local named eval": "def f(model):\n    eval = model.eval\n    return eval()\n",
    "a membership test on sys.path": "import sys\nKNOWN = '/x' in sys.path\n",
    "numpy.load without pickles": "import numpy\nX = numpy.load('x.npy', allow_pickle=False)\n",
    # names the scan once refused as the harness's, though no harness object in a candidate's process has them
    "a CUDA event recorded": "import torch\ndef f():\n    torch.cuda.Event(enable_timing=True).record()\n",
    "a traced module": "import torch\ndef f(model, x):\n    return torch.jit.trace(model, x)\n",
    "a controller's own clock and policy version": (
        "class C:\n    def __init__(self):\n        self.clock, self.policy_version, self.trace = 0.0, 0, []\n"
    ),
    "a wrapper's inner cluster": "class W:\n    def __init__(self, inner):\n        self.inner = inner\n",
}


def test_the_scan_names_where_the_proxies_keep_their_channel():
    """The scan refuses ``._calls``, ``._memory`` and ``._call`` because the proxies a candidate is handed keep
    their channel and prompt memory there, and send any method by the last: a proxy renaming them would leave
    the rule naming nothing."""
    from targets.harness.isolation.candidate_process import ProxyCluster, ProxyEnvs, ProxyEpisode
    from targets.harness.judge.integrity import HARNESS_ATTRIBUTES

    calls, memory = object(), object()

    async def proxies():
        return [ProxyCluster(calls, [], memory), ProxyEpisode(calls, "e0", "g0"), ProxyEnvs(calls, 2, memory)]

    made = asyncio.run(proxies())
    kept = {
        name
        for proxy in made
        for name in getattr(proxy, "__slots__", None) or vars(proxy)
        if getattr(proxy, name) in (calls, memory)
    }
    methods = {n for proxy in made for n, v in vars(type(proxy)).items() if n.startswith("_") and callable(v)}
    assert kept | {n for n in methods if not n.startswith("__")} == HARNESS_ATTRIBUTES


@pytest.mark.parametrize("name", list(LOOKALIKES))
def test_integrity_scan_lets_through_what_only_looks_like_an_escape(tmp_path, tiny_spec, name):
    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    (stack / "stack" / "lookalike.py").write_text(LOOKALIKES[name])
    result = scan_stack(stack)
    assert result.passed, result.reasons


class _FinalizedGarbage:
    """Garbage whose finalizer runs Python code: a collection during a parse hands the GIL over."""

    def __del__(self):
        sum(range(50))


def test_parallel_scans_of_one_stack_agree(tmp_path, tiny_spec):
    """A simulated bench scans its stacks from several threads at once; CPython 3.11's ast.parse is not
    safe for that (SystemError "AST constructor recursion depth mismatch"), so the scan parses under a lock.
    Without ``AST_PARSE_LOCK`` this test raises that SystemError."""
    stack = write_starter(tmp_path / "s", tiny_spec, "time_multiplex")
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []

    def scan_repeatedly():
        for _ in range(5):  # without the lock: failed 3 runs of 3 here (5 of 5 at 8, 5 of 6 at 4)
            garbage = [_FinalizedGarbage() for _ in range(100)]
            for item in garbage:
                item.cycle = item
            del garbage
            integrity._scanned.clear()  # every file parsed again, in parallel with the other threads
            try:
                assert scan_stack(stack).passed
            except BaseException as error:  # noqa: BLE001 -- handed to the main thread, which raises it
                errors.append(error)
                return

    try:
        threads = [threading.Thread(target=scan_repeatedly) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)
    assert not errors, errors[0]


# -- DESIGN.md ------------------------------------------------------------------------------------


def test_design_doc_round_trips_and_tracks_statuses():
    doc = DesignDoc.parse(
        "# Stack design\n\n## Decisions\n- Round 0: starter.\n\n## Plan\n1. [DONE] Starter stack.\n\n## "
        "Findings\n(none yet)\n"
    )
    doc.set_status("controller=time_multiplex", "switch to time_multiplex", "IN_PROGRESS")
    doc.set_status(
        "batch_window_s=0.004", "set batch_window_s", "ABANDONED", "round 2: no gain beyond the noise threshold"
    )
    again = DesignDoc.parse(doc.render())
    assert [(s.status, s.id) for s in again.plan] == [
        ("DONE", ""),
        ("IN_PROGRESS", "controller=time_multiplex"),
        ("ABANDONED", "batch_window_s=0.004"),
    ]
    assert again.plan[2].reason == "round 2: no gain beyond the noise threshold" and again.decisions == [
        "Round 0: starter."
    ]
    with pytest.raises(ValueError, match="needs a reason"):
        doc.set_status("x", "x", "ABANDONED")


# -- the offline planner and the evaluator's hints -----------------------------------------------


def test_every_skill_has_front_matter_and_the_planner_maps_hints_to_them(tiny_spec, big_spec):
    skills = load_skills()
    assert {"colocate", "static_split", "time_multiplex", "paged_engine", "fsdp_trainer"} <= set(skills)
    planner = OfflinePlanner(tiny_spec)
    params = {"controller": "colocate", "engine": "paged", "micro_batch_tokens": 4096}
    tasks = planner.tasks_from_hints(
        [Hint(code="rollout_stalls", message="no rollout in flight for 35% of the run")], params
    )
    assert {t.id for t in tasks} == {"controller=static_split", "controller=time_multiplex", "add-redundant_envs"}
    assert all("35%" in t.rationale for t in tasks)
    assert {t.id: t.priority for t in tasks}["add-redundant_envs"] == 8  # a controller switch (10) first
    big = OfflinePlanner(big_spec, engine_devices=8)
    moved = big.tasks_from_hints(
        [Hint(code="small_engine_batches", message="engines batch 1.7")],
        {"controller": "static_split", "train_devices": 64},
    )
    # a real target's small batches: more devices to train, or drafts for each decode step
    assert [t.changes for t in moved if not t.id.startswith("controller=")] == [
        {"train_devices": 72},
        {"speculative_tokens": 4},
    ]


def test_on_one_device_the_planner_never_switches_to_a_controller_that_needs_two(tiny_spec):
    """The one-GPU target's generate crashed in round 1 (its rehearsal on CPU found it): the planner
    proposed time_multiplex, which needs a device that never trains. Only colocate fits one device;
    the hints then propose techniques that run under it."""
    from skills.starter import starter_params, unfit

    one = tiny_spec.model_copy(update={"hardware": tiny_spec.hardware.model_copy(update={"count": 1})})
    planner = OfflinePlanner(one)
    params = starter_params(one, "colocate")
    hints = [Hint(code="rollout_stalls", message="no rollout in flight for 35% of the run")]
    tasks = planner.tasks_from_hints(hints, params) + planner.composition_tasks(params)
    assert tasks and not [t.id for t in tasks if t.id.startswith("controller=")], [t.id for t in tasks]
    assert unfit(one, "colocate") is None and "one device" in unfit(one, "static_split")
    with pytest.raises(ValueError, match="one device"):
        starter_params(one, "time_multiplex")


def test_a_controller_switch_switches_off_the_techniques_the_new_controller_cannot_run(tmp_path, tiny_spec):
    """A switch from a time_multiplex best kept progress_shrink, stream_training and overlap_sync on: no
    other controller reads them, so the static split carried three techniques in name only, later rounds
    tuned and removed them, and novelty took those do-nothing variants for new stacks. The switch now
    turns them off with it and says so; the implementer refuses parameters with one stranded."""
    from agents.offline.implementer import ImplementationError, OfflineImplementer
    from skills.starter import starter_params

    spec = load_target("qwen3-8b-h800x16")
    planner = OfflinePlanner(spec, simulated=True)
    params = {**starter_params(spec, "time_multiplex"), "shrink_at": 0.4, "stream_train": 1, "overlap_sync": 1}
    assert planner.stranded(params) == []
    switch = planner._controller_task(planner.skills["static_split"], None, params)
    after = {**params, **switch.changes}
    assert after["controller"] == "static_split" and planner.stranded(after) == [] and planner.applies(switch, params)
    for technique in ("progress_shrink", "stream_training", "overlap_sync"):
        assert not planner.skills[technique].is_on(after) and technique in switch.rationale
    stale = switch.model_copy(update={"changes": {k: v for k, v in switch.changes.items() if k in ("controller",)}})
    assert not planner.applies(stale, params)  # a switch that would strand them is no longer a move
    assert planner.as_on(stale, params).changes == switch.changes  # ... until written for this parent (the backlog)
    # the implementer refuses a task whose parameters strand a technique
    workspace = write_starter(tmp_path / "ws", tiny_spec, "time_multiplex")
    (workspace / "stack" / "params.json").write_text(
        json.dumps({**starter_params(tiny_spec, "time_multiplex"), "overlap_sync": 1})
    )
    to_colocate = Task(
        id="controller=colocate", title="switch", rationale="", skills=["colocate"], changes={"controller": "colocate"}
    )
    with pytest.raises(ImplementationError, match="overlap_sync cannot run with these parameters"):
        OfflineImplementer(tiny_spec, OfflinePlanner(tiny_spec)).implement(to_colocate, workspace, [])
    # a parent already stranded (a run from before this rule) is not a reason to refuse every task on it
    colocated = {**starter_params(tiny_spec, "colocate"), "stream_train": 1}
    (workspace / "stack" / "params.json").write_text(json.dumps(colocated))
    move = Task(id="async_ratio=0", title="move", rationale="", skills=["colocate"], changes={"async_ratio": 0})
    OfflineImplementer(tiny_spec, OfflinePlanner(tiny_spec)).implement(move, workspace, [])


def test_the_planner_moves_only_to_device_counts_the_stack_can_place():
    """A 20-round search on the judged target lost round 17 to "set train_devices to 9" on a static
    split already rolling out on 8 of its 16 devices: the build refused it. A range per parameter cannot
    say that; the planner now checks that the stack's devices add up, for its moves and its backlog."""
    from skills.starter import starter_params

    spec = load_target("qwen3-8b-h800x16-judge")
    planner = OfflinePlanner(spec, simulated=True)
    params = starter_params(spec, "static_split")  # 8 rolling out + 8 training: every device placed
    assert (params["rollout_devices"], params["train_devices"]) == (8, 8)
    assert planner.legal("train_devices", 9) and not planner.fits({**params, "train_devices": 9})
    moves = {(k, v) for t in planner.parameter_moves(params) for k, v in t.changes.items()}
    assert ("train_devices", 7) in moves and ("train_devices", 9) not in moves
    hints = [Hint(code="train_devices_idle", message="x"), Hint(code="tail_idle", message="y")]
    for task in planner.tasks_from_hints(hints, params) + planner.composition_tasks(params):
        assert planner.fits({**params, **task.changes}), task.id
    stale = next(
        t for t in planner.parameter_moves({**params, "rollout_devices": 4}) if t.changes == {"train_devices": 9}
    )
    assert not planner.applies(stale, params)  # planned on a parent rolling out on 4, it no longer fits
    judged = {**params, "rollout_devices": 4, "reward_placement": 1, "reward_devices": 4}  # 4 + 8 + 4 judge
    assert planner.fits(judged) and not planner.fits({**judged, "reward_devices": 5})


def test_the_planner_never_moves_a_parameter_so_that_a_technique_loses_what_it_requires(big_spec):
    """Stream training requires progress_shrink: doubling shrink_at 0.5 switches that off (1.0), which
    would leave a stack its controller refuses; removing progress_shrink is refused the same way."""
    planner = OfflinePlanner(big_spec, engine_devices=8, seed=1)
    params = {"controller": "time_multiplex", "train_devices": 128, "shrink_at": 0.5, "stream_train": 1}
    assert planner.fits(params) and not planner.fits({**params, "shrink_at": 1.0})
    moves = {(k, v) for t in planner.parameter_moves(params) for k, v in t.changes.items()}
    assert ("shrink_at", 0.25) in moves and ("shrink_at", 1.0) not in moves
    removals = {t.id for t in planner.composition_tasks(params) if t.id.startswith("remove-")}
    assert removals == {"remove-stream_training"}  # never progress_shrink while stream training needs it


def test_perturbations_stay_in_range_and_move_whole_engines(big_spec):
    planner = OfflinePlanner(big_spec, engine_devices=8, seed=1)
    params = {"controller": "time_multiplex", "train_devices": 128, "micro_batch_tokens": 4096}
    for _ in range(30):
        task = planner.perturbation(params)
        for name, value in task.changes.items():
            assert planner.legal(name, value)
            if name == "train_devices":
                assert value % 8 == 0 and value in (120, 136)
    assert not planner.legal("train_devices", 130) and not planner.legal("micro_batch_tokens", 1)
    assert not planner.legal("kv_routng", 1)  # a name no skill declares: nothing would read it
    assert planner.legal("controller", "static_split") and planner.legal("rollout_devices", 1)  # the structure


def test_the_planner_grows_engines_only_where_the_target_lets_them_and_in_whole_engines(big_spec):
    """engine_scale 2 (engines of 16 on the 235B target) fits only a target whose
    ``simulator.max_engine_scale`` allows it, with its training devices in whole engines of 16; a
    ``tail_idle`` finding proposes it there, and nowhere else."""
    params = {"controller": "time_multiplex", "train_devices": 128, "micro_batch_tokens": 4096}
    tail = [Hint(code="tail_idle", message="the tail holds the step")]
    planner = OfflinePlanner(big_spec, engine_devices=8, simulated=True)
    assert not planner.fits({**params, "engine_scale": 2})
    assert "add-engine_scale" not in {t.id for t in planner.tasks_from_hints(tail, params)}
    simulator = big_spec.simulator.model_copy(update={"max_engine_scale": 2})
    planner = OfflinePlanner(big_spec.model_copy(update={"simulator": simulator}), engine_devices=8, simulated=True)
    assert planner.fits({**params, "engine_scale": 2}) and planner.fits({**params, "train_devices": 120})
    assert not planner.fits({**params, "engine_scale": 2, "train_devices": 120})
    added = next(t for t in planner.tasks_from_hints(tail, params) if t.id == "add-engine_scale")
    assert added.changes == {"engine_scale": 2}


def test_what_a_stack_declares_stays_within_what_the_workload_bounds(tiny_spec):
    """The harness refuses a declaration over ``WorkloadSpec.declared_limits`` at hello, so the
    planner never proposes one: tail_round up to the groups of a step, spares up to a group; a
    technique switched on beyond the limit is switched on at it."""
    planner = OfflinePlanner(tiny_spec)  # 8 groups of 4 a step
    assert planner.legal("tail_round", 8) and not planner.legal("tail_round", 16)
    small = tiny_spec.workload.model_copy(update={"batch_size": 8, "group_size": 2})  # 4 groups of 2
    planner = OfflinePlanner(tiny_spec.model_copy(update={"workload": small}))
    assert not planner.legal("tail_round", 8) and not planner.legal("redundant_envs", 3)
    assert planner.legal("redundant_envs", 2)
    assert not planner.legal("async_ratio", small.staleness_limit + 1)
    multiplexed = {"controller": "time_multiplex", "train_devices": 1}
    added = {t.id: t.changes for t in planner.composition_tasks(multiplexed)}
    assert added["add-tail_batching"] == {"tail_round": 4}  # the skill's 8, down to the step's 4 groups
    assert added["add-redundant_envs"] == {"redundant_envs": 2}


def test_composition_adds_what_the_controller_allows_and_removes_what_is_on(tiny_spec):
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    multiplexed = starter_params(tiny_spec, "time_multiplex")
    added = {t.id: t.changes for t in planner.composition_tasks(multiplexed)}
    assert added["add-overlap_sync"] == {"overlap_sync": 1} and added["add-tail_batching"] == {"tail_round": 8}
    assert not [i for i in added if i.startswith("remove-")]
    colocated = {t.id for t in planner.composition_tasks(starter_params(tiny_spec, "colocate"))}
    # the engine's speculative decoding runs under any; the others need another controller
    engine_techniques = {"add-speculative_decoding", "add-kv_host_tier", "add-chunked_prefill"}
    assert colocated == {"add-redundant_envs", "add-kv_routing", *engine_techniques}
    # starting environments ahead is proposed only where a reset takes time (here it would change nothing)
    from targets.spec import Fixed

    slow = tiny_spec.workload.model_copy(update={"env_reset_s": Fixed(kind="fixed", value=60.0)})
    resetting = OfflinePlanner(tiny_spec.model_copy(update={"workload": slow}))
    added = {t.id for t in resetting.composition_tasks(starter_params(tiny_spec, "colocate"))}
    assert added == colocated | {"add-env_prestart"}
    # on-policy at any staleness bound (it declares its own in-flight groups): proposed at async_ratio 0 too
    unbounded = {**starter_params(tiny_spec, "colocate"), "async_ratio": 0}
    assert "add-env_prestart" in {t.id for t in resetting.composition_tasks(unbounded)}
    on = {**multiplexed, "partial_rollout": 1}
    ids = {t.id for t in planner.composition_tasks(on)}
    assert "remove-partial_rollout" in ids and "add-partial_rollout" not in ids
    removal = next(t for t in planner.composition_tasks(on) if t.id == "remove-partial_rollout")
    assert removal.changes == {"partial_rollout": 0}
    # a hint never proposes a technique the controller cannot run
    hinted = planner.tasks_from_hints([Hint(code="tail_idle", message="tail")], starter_params(tiny_spec, "colocate"))
    assert not {k for t in hinted for k in t.changes} & {"shrink_at", "partial_rollout", "tail_round"}


def test_a_hint_switches_a_technique_on_as_composition_would_and_ranks_by_findings_answered(tiny_spec):
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    multiplexed = starter_params(tiny_spec, "time_multiplex")
    composed = {t.id: t.changes for t in planner.composition_tasks(multiplexed)}
    tail = Hint(code="tail_idle", message="the tail idles 30% of the run")
    hinted = {t.id: t for t in planner.tasks_from_hints([tail], multiplexed)}
    # the same task (id and changes) whichever way it is reached: the skill's enable, not a one-step move
    assert hinted["add-redundant_envs"].changes == composed["add-redundant_envs"] == {"redundant_envs": 2}
    assert hinted["add-progress_shrink"].changes == {"shrink_at": 0.4}
    assert "tail idles 30%" in hinted["add-redundant_envs"].rationale
    assert hinted["add-redundant_envs"].source == "trigger:tail_idle"
    assert not [i for i in hinted if i.startswith(("redundant_envs=", "shrink_at=", "route_"))]  # nothing moot moved
    stalls = Hint(code="rollout_stalls", message="no rollout in flight for 40%")
    ranked = {t.id: t.priority for t in planner.tasks_from_hints([tail, stalls, tail], multiplexed)}
    assert ranked["add-redundant_envs"] == 9 and ranked["add-kv_routing"] == 8  # answers two findings, not one
    assert max(ranked.values()) == ranked["controller=static_split"] == 10  # a controller switch still comes first
    alone = {t.id for t in planner.tasks_from_hints([stalls], multiplexed)}
    assert "add-redundant_envs" in alone  # any finding the skill lists as a trigger proposes it
    assert len([t for t in planner.tasks_from_hints([tail, tail], multiplexed) if t.id == "add-kv_routing"]) == 1
    # once on, a hint moves it from there
    moved = {t.id: t.changes for t in planner.tasks_from_hints([tail], {**multiplexed, "redundant_envs": 2})}
    assert moved["redundant_envs=3"] == {"redundant_envs": 3}


def test_composition_honours_requires_and_conflicts(tiny_spec):
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    skills = dict(planner.skills)
    skills["kv_routing"] = skills["kv_routing"].model_copy(update={"conflicts": ["redundant_envs"]})
    skills["overlap_sync"] = skills["overlap_sync"].model_copy(update={"requires": ["partial_rollout"]})
    planner.skills = skills
    params = starter_params(tiny_spec, "time_multiplex")
    ids = {t.id for t in planner.composition_tasks(params)}
    assert "add-overlap_sync" not in ids and "add-kv_routing" in ids
    ids = {t.id for t in planner.composition_tasks({**params, "redundant_envs": 2, "partial_rollout": 1})}
    assert "add-kv_routing" not in ids and "add-overlap_sync" in ids
    ids = {t.id for t in planner.composition_tasks({**params, "partial_rollout": 1, "overlap_sync": 1})}
    assert "remove-overlap_sync" in ids and "remove-partial_rollout" not in ids  # overlap_sync needs it


def test_a_skill_naming_what_the_library_lacks_is_refused(tmp_path):
    from skills.library import load_skills

    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "SKILL.md").write_text(
        "---\nname: odd\nkind: technique\nrecipe: x.py\ncontrollers: [time_multiplx]\n"
        "params:\n  odd: {type: int, min: 0, max: 1, default: 0}\nenable: {odd: 1}\n---\nbody\n"
    )
    with pytest.raises(ValueError, match="controllers: time_multiplx"):
        load_skills(tmp_path)


def _backlog_state(best, *, backlog=(), rounds=None, tried=None, abandoned=()):
    """What the backlog policy reads of a run's state: its best, backlog, rounds, what was tried on
    which parent and what was given up on, with no near miss to try again (``rounds`` and ``tried``
    stay live: a test adds to them)."""
    from types import SimpleNamespace

    rounds = [] if rounds is None else rounds
    tried = set() if tried is None else tried
    return SimpleNamespace(
        best=best,
        backlog=list(backlog),
        rounds=rounds,
        accepted=lambda: [r for r in rounds if r.verdict == "accepted"],
        tried=lambda: tried,
        abandoned=lambda: set(abandoned),
        near_misses=lambda: [],
    )


def test_a_change_whose_round_ended_in_an_error_is_tried_once_more_and_never_counted_built():
    """A round ending in an error (the best failing beside the candidate, a git error) never judged its
    candidate, yet its change counted as tried on that parent and its configuration as built everywhere:
    never retried, not even by the backlog's final sweep. It is tried once more; a second error closes it."""
    from orchestrator.policies.novelty import built_configurations
    from orchestrator.state import RoundRecord, RunConfig, new_state

    state = new_state(RunConfig(rounds=5, policy="backlog", agents="offline", seed=0))
    task = Task(id="add-x", title="add x", rationale="r", changes={"x": 1})

    def round_(n, verdict, parent="c0", commit=None):
        return RoundRecord(round=n, task=task, parent_round=0, parent_commit=parent, verdict=verdict, commit=commit)

    starter = Task(id="starter", title="s", rationale="r", source="starter")
    state.rounds = [
        RoundRecord(round=0, task=starter, parent_round=None, parent_commit="", verdict="accepted", commit="c0")
    ]
    state.rounds.append(round_(1, "error"))
    assert ("c0", "add-x") not in state.tried()
    assert built_configurations(state, lambda record: {"x": 0}) == [{"x": 0}]  # the parent's alone
    state.rounds.append(round_(2, "error"))
    assert ("c0", "add-x") in state.tried()  # an error that always comes does not loop
    state.rounds = state.rounds[:1] + [round_(1, "rejected")]
    assert ("c0", "add-x") in state.tried() and {"x": 1} in built_configurations(state, lambda record: {"x": 0})


def test_a_dry_backlog_composes_before_it_perturbs(tiny_spec):
    from types import SimpleNamespace

    from orchestrator.policies.backlog import BacklogPolicy
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    params = starter_params(tiny_spec, "time_multiplex")
    tried: set = set()
    state = _backlog_state(SimpleNamespace(commit="c0"), tried=tried)
    policy = BacklogPolicy(planner, seed=0)
    composed = []
    while (proposal := policy.propose(state, lambda record: params)) and proposal[1].source == "composition":
        composed.append(proposal[1].id)
        tried.add(("c0", proposal[1].id))
    assert sorted(composed) == sorted(t.id for t in planner.composition_tasks(params)) and len(composed) >= 5
    assert proposal[1].source == "mutation"  # then parameter moves


def test_a_dry_backlog_stops_only_when_every_move_and_composition_was_tried_on_the_best(tiny_spec):
    """The run stops on its budget while anything is untried on the best: every legal parameter move
    (not a few random draws), then the compositions and the moves given up on under an earlier best, which
    the rest of this best's set may now favour (a move abandoned once was never tried again, on any best).
    Only then is there nothing left."""
    from types import SimpleNamespace

    from orchestrator.policies.backlog import BacklogPolicy
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    params = starter_params(tiny_spec, "time_multiplex")
    compositions = {t.id for t in planner.composition_tasks(params)}
    moves = {t.id for t in planner.parameter_moves(params)}
    assert len(moves) >= 4 and not moves & compositions
    tried: set = set()
    # each composition, and one move, measured without gain on the earlier best, c0
    given_up = sorted(moves)[0]
    state = _backlog_state(SimpleNamespace(commit="c1"), tried=tried, abandoned=compositions | {given_up})
    proposed = []
    while proposal := BacklogPolicy(planner, seed=3).propose(state, lambda record: params):
        assert proposal[1].id not in proposed, proposal[1].id
        proposed.append(proposal[1].id)
        tried.add(("c1", proposal[1].id))
    fresh = len(moves) - 1
    assert set(proposed[:fresh]) == moves - {given_up}  # every move first, then the abandoned compositions
    assert set(proposed[fresh:-1]) == compositions and proposed[-1] == given_up  # and the abandoned move
    again = []
    tried.clear()
    while (proposal := BacklogPolicy(planner, seed=3).propose(state, lambda record: params)) and len(again) < 3:
        again.append(proposal[1].id)
        tried.add(("c1", proposal[1].id))
    assert again == proposed[:3]  # one order for a seed and a parent, resumed or not


def test_a_controller_switch_that_lost_is_followed_once_by_the_technique_its_findings_call_for(tiny_spec):
    """The long-CoT target's trap: time_multiplex alone loses to colocate (its syncs drain 16K-token
    turns), time_multiplex + partial_rollout wins by 1.3x, and partial_rollout cannot go on colocate.
    The backlog follows the losing switch with what its own findings (slow_sync, tail_idle) call for
    most, on the switch itself; once followed up, it goes back to the best."""
    from types import SimpleNamespace

    from agents.roles import Task
    from orchestrator.policies.backlog import BacklogPolicy
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    colocate, multiplexed = starter_params(tiny_spec, "colocate"), starter_params(tiny_spec, "time_multiplex")
    hints = [Hint(code="slow_sync", message="sync 40%"), Hint(code="tail_idle", message="tail 30%")]

    def record(commit, parent, task, became_best, hints=()):
        return SimpleNamespace(
            commit=commit, parent_commit=parent, task=task, verdict="accepted", became_best=became_best, hints=hints
        )

    best = record("c0", "", Task(id="starter", title="s", rationale="r"), True)
    switch = record("c1", "c0", Task(id="controller=time_multiplex", title="t", rationale="r"), False, hints)
    rounds, tried = [best, switch], {("c0", "controller=time_multiplex")}
    state = _backlog_state(best, rounds=rounds, tried=tried, abandoned={"controller=time_multiplex"})
    params_of = {"c0": colocate, "c1": multiplexed}
    parent, task = BacklogPolicy(planner, seed=0).propose(state, lambda record: params_of[record.commit])
    assert parent is switch and task.id == "add-partial_rollout", (parent.commit, task.id)
    rounds.append(record("c2", "c1", task, False))
    tried.add(("c1", task.id))
    params_of["c2"] = {**multiplexed, **task.changes}
    parent, task = BacklogPolicy(planner, seed=0).propose(state, lambda record: params_of[record.commit])
    assert parent is best and task.id != "add-partial_rollout"
    # of techniques the findings call for equally, the one the planner ranks first (the alphabet's last
    # won before: tail_batching over kv_routing, partial_rollout, progress_shrink and redundant_envs)
    tail = record("c3", "c0", Task(id="controller=time_multiplex", title="t", rationale="r"), False, hints[1:])
    state = _backlog_state(best, rounds=[best, tail], tried={("c0", "controller=time_multiplex")}, abandoned=set())
    ranked = [t.id for t in planner.tasks_from_hints(hints[1:], multiplexed) if t.id.startswith("add-")]
    params_of["c3"] = multiplexed
    parent, task = BacklogPolicy(planner, seed=0).propose(state, lambda record: params_of[record.commit])
    assert parent is tail and task.id == ranked[0] == "add-kv_routing", (task.id, ranked)


def _validated_round(n, parent, task, best, paired=None):
    """Round ``n``: ``task`` validated on ``parent`` as commit ``c<n>``, promoted or not, with its pair."""
    from orchestrator.state import RoundRecord

    return RoundRecord(
        round=n,
        task=task,
        parent_round=None,
        parent_commit=parent,
        verdict="accepted",
        commit=f"c{n}",
        became_best=best,
        paired=paired,
    )


def test_a_technique_tried_only_on_a_losing_controller_switch_is_not_given_up_on():
    """Round 2 switches to static_split and loses; round 3 follows it up with the host tier (on static
    split, so it loses to the best too); round 4 adds redundant_envs to the best and loses. Only the
    switch and round 4's task are given up on: the tier was never tried on the best's line."""
    from orchestrator.state import RunState

    def record(n, parent, task, best):
        return _validated_round(n, parent, Task(id=task, title=task, rationale="r"), best)

    rounds = [
        record(0, "", "starter", True),
        record(1, "c0", "controller=time_multiplex", True),
        record(2, "c1", "controller=static_split", False),
        record(3, "c2", "add-kv_host_tier", False),
        record(4, "c1", "add-redundant_envs", False),
    ]
    assert RunState.model_construct(rounds=rounds).abandoned() == {"controller=static_split", "add-redundant_envs"}


def test_a_stacks_design_record_says_each_task_s_latest_trial_and_done_only_for_its_own_line(tmp_path, tiny_spec):
    """The plan kept the first result written for a task: add-x, a near miss in round 1 and then promoted
    in round 3, read ABANDONED on another branch; a task rejected on one best stayed NOT_STARTED (the
    backlog's pending entry) on the next; add-y, done on a line this stack does not descend from, read
    DONE. Each step now says its latest trial, DONE only where this stack descends from it."""
    from orchestrator.design_record import update_design
    from orchestrator.state import Promotion, RoundRecord, RunConfig, new_state

    def T(name):
        return Task(id=name, title=name, rationale="r")

    pair = Promotion(ratio=1.01, low=0.99, high=1.03, pairs=3, threshold=0.02)

    def validated(n, parent, task, best):
        return RoundRecord(
            round=n,
            task=T(task),
            parent_round=0,
            parent_commit=parent,
            verdict="accepted",
            commit=f"c{n}",
            headline=1.0 + n / 10,
            became_best=best,
            paired=pair,
        )

    state = new_state(RunConfig(rounds=9, policy="backlog", agents="offline", seed=0))
    starter = Task(id="starter", title="s", rationale="r", source="starter")
    state.rounds = [
        RoundRecord(
            round=0,
            task=starter,
            parent_round=None,
            parent_commit="",
            verdict="accepted",
            commit="c0",
            became_best=True,
        ),
        validated(1, "c0", "add-x", False),  # a near miss
        validated(2, "c0", "add-y", True),
        validated(3, "c2", "add-x", True),
        RoundRecord(round=4, task=T("add-z"), parent_round=3, parent_commit="c3", verdict="rejected", reasons=["slow"]),
        RoundRecord(round=5, task=T("add-q"), parent_round=3, parent_commit="c3", verdict="error", reasons=["git"]),
    ]
    state.backlog = [T("add-z")]
    (tmp_path / "DESIGN.md").write_text(DesignDoc.starter("colocate", {}).render())
    on_the_line = RoundRecord(
        round=6, task=T("add-w"), parent_round=3, parent_commit="c3", verdict="rejected", reasons=["x"]
    )
    update_design(tmp_path, on_the_line, state, tiny_spec, DesignDoc.starter("colocate", {}).render())
    plan = {step.id: (step.status, step.reason) for step in DesignDoc.load(tmp_path / "DESIGN.md").plan}
    assert plan["add-x"][0] == "DONE" and plan["add-y"][0] == "DONE"  # round 3 on round 2's line, this stack's
    assert plan["add-z"][0] == "ABANDONED" and "round 4 rejected: slow" in plan["add-z"][1]  # not NOT_STARTED
    assert plan["add-q"][0] == "NOT_STARTED" and "tried again" in plan["add-q"][1]  # an error: never judged
    (tmp_path / "DESIGN.md").write_text(DesignDoc.starter("colocate", {}).render())
    elsewhere = RoundRecord(
        round=6, task=T("add-w"), parent_round=1, parent_commit="c1", verdict="rejected", reasons=["x"]
    )
    update_design(
        tmp_path, elsewhere, state, tiny_spec, DesignDoc.starter("colocate", {}).render()
    )  # a stack on round 1's line (evolve's parent)
    plan = {step.id: (step.status, step.reason) for step in DesignDoc.load(tmp_path / "DESIGN.md").plan}
    assert plan["add-x"][0] == "DONE"  # round 1's own change, which this stack holds
    assert plan["add-y"][0] == "ABANDONED" and "another line" in plan["add-y"][1]


def test_what_an_implementer_writes_in_design_md_is_kept_as_its_notes_never_as_the_loops_record(tmp_path, tiny_spec):
    """A red team's implementer wrote a decision "Round 1: ... Measured goodput 55.1" for a round that was
    rejected, a finding with an interval, and a plan step of a taken id: the best's DESIGN.md stated them as
    the loop's record. The loop's sections are rebuilt on the parent's as committed; what the implementer
    wrote is kept under Notes, each line its round's implementer's, escaped."""
    from orchestrator.design_record import update_design
    from orchestrator.state import RoundRecord, RunConfig, new_state

    parent = DesignDoc.starter("colocate", {}).render()
    forged = DesignDoc.parse(parent)
    forged.decisions.append("Round 1: tail round 8. Measured goodput 55.1 (parent 42.5).")
    forged.findings.append("Round 2: tail batching 1.9x [1.7, 2.1]")
    forged.plan.append(forged.plan[0].__class__("Tail batching.", "DONE", "add-w"))
    (tmp_path / "DESIGN.md").write_text(forged.render() + "\n## Ideas\n\x1b[2Ktry a longer window\n")
    state = new_state(RunConfig(rounds=9, policy="backlog", agents="offline", seed=0))
    record = RoundRecord(
        round=2,
        task=Task(id="add-w", title="add w", rationale="r"),
        parent_round=0,
        parent_commit="c0",
        verdict="rejected",
        reasons=["x"],
    )
    update_design(tmp_path, record, state, tiny_spec, parent)
    doc = DesignDoc.load(tmp_path / "DESIGN.md")
    assert doc.decisions == DesignDoc.parse(parent).decisions and doc.findings == []
    assert [step.id for step in doc.plan] == ["", "add-w"]
    assert doc.notes == [
        "Round 2's implementer: Round 1: tail round 8. Measured goodput 55.1 (parent 42.5).",
        "Round 2's implementer: Tail batching.",
        "Round 2's implementer: Round 2: tail batching 1.9x [1.7, 2.1]",
        "Round 2's implementer: \\x1b[2Ktry a longer window",
    ]
    assert "## Notes (the implementers' own words, unchecked)" in (tmp_path / "DESIGN.md").read_text()
    # the loop's own entries of several lines (a reason quoting a traceback, one that names a section) read back
    # as they were: the next round, rebuilt on this one untouched, adds no note and no decision
    crashed = RoundRecord(
        round=3,
        task=Task(id="add-v", title="add v", rationale="r"),
        parent_round=0,
        parent_commit="c0",
        verdict="rejected",
        reasons=["the controller raised E: x\nTraceback (most recent call last):\n## Decisions\n- Round 2: forged"],
    )
    state.rounds = [record.model_copy(update={"commit": "c2"}), crashed]
    committed = (tmp_path / "DESIGN.md").read_text()
    update_design(tmp_path, crashed.model_copy(update={"round": 4}), state, tiny_spec, committed)
    again = DesignDoc.load(tmp_path / "DESIGN.md")
    assert again.notes == doc.notes and again.decisions == doc.decisions
    # an implementer's notes are kept to 50 lines a round, the rest counted
    (tmp_path / "DESIGN.md").write_text(committed + "".join(f"- idea {i}\n" for i in range(60)))
    update_design(tmp_path, crashed.model_copy(update={"round": 5}), state, tiny_spec, committed)
    notes = DesignDoc.load(tmp_path / "DESIGN.md").notes
    assert len(notes) == len(doc.notes) + 51 and notes[-1] == "Round 5's implementer: (10 more lines not kept)"
    # a plan step's title holding what ends a step's text in the format (an LLM planner's em dash, "(id: ")
    titled = DesignDoc(plan=[Step("Overlap rollout — async sync (id: x)", "ABANDONED", "t1", "lost — (id: y)")])
    assert DesignDoc.parse(titled.render()).plan == [
        Step("Overlap rollout - async sync (id x)", "ABANDONED", "t1", "lost — (id: y)")
    ]


def test_the_offline_planner_quotes_an_llm_evaluators_hint_as_its_reading(tiny_spec):
    """With LLM agents the planner is the offline one: it copied an LLM evaluator's hint into the next task's
    rationale, where it read as the trace's figure in show, the commit and DESIGN.md."""
    planner = OfflinePlanner(tiny_spec)
    params = {"controller": "colocate", "engine": "paged", "micro_batch_tokens": 4096}
    hint = Hint(code="rollout_stalls", message="rollout looks stalled", by="llm")
    tasks = planner.tasks_from_hints([hint], params)
    assert tasks and all("rollout looks stalled (the LLM evaluator's reading)" in t.rationale for t in tasks)


def test_a_near_miss_is_tried_once_more_on_a_later_best_before_its_removals_and_moves(tiny_spec):
    """The paper-scale search's host tier came out +0.9% on round 4's best (inside the 2% threshold) and
    was never tried again, though it gave 12-19% on the lines that kept it. A gain inside the noise is
    tried again on the next best, after the additions never tried and before the removals and parameter
    moves; a loss gives a task up at once, a second near miss too."""
    from orchestrator.design_record import status
    from orchestrator.policies.backlog import BacklogPolicy
    from orchestrator.state import Promotion, RunState
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    p0 = starter_params(tiny_spec, "time_multiplex")
    add = {t.id: t for t in planner.composition_tasks(p0)}
    chosen = ["add-kv_routing", "add-abort_stale", "add-overlap_sync"]
    assert set(chosen) <= set(add), sorted(add)

    def record(n, parent, task, ratio, best=False):
        paired = None if ratio is None else Promotion(ratio=ratio, low=ratio, high=ratio, pairs=1, threshold=0.02)
        return _validated_round(n, parent, task, best, paired)

    starter = Task(id="starter", title="s", rationale="r")
    rounds = [
        record(0, "", starter, None, best=True),
        record(1, "c0", add[chosen[0]], 1.009),  # a near miss
        record(2, "c0", add[chosen[1]], 0.95),  # a loss
        record(3, "c0", add[chosen[2]], 1.004),  # a smaller near miss
    ]
    state = RunState.model_construct(rounds=rounds, backlog=[], best_round=0)
    assert state.abandoned() == {chosen[1]}
    assert [r.task.id for r in state.near_misses()] == [chosen[0], chosen[2]]  # the closest first
    assert "near miss" in status(rounds[1])[1] and "near miss" not in status(rounds[2])[1]  # the plan says so
    # a later best (c4, two more techniques on): every addition never tried first, then the near misses
    others = [t for t in add.values() if t.id not in chosen and t.id != "add-stream_training"][:2]
    rounds.append(record(4, "c0", others[0], 1.2, best=True))
    state.best_round = 4
    p4 = {**p0, **others[0].changes, **others[1].changes}
    assert planner.fits(p4)
    policy, proposed = BacklogPolicy(planner, seed=0), []
    while (proposal := policy.propose(state, lambda r: p4 if r.commit == "c4" else p0)) and not (
        proposal[1].id.startswith("remove-") or proposal[1].source == "mutation"
    ):
        rounds.append(record(len(rounds), "c4", proposal[1], 0.9))  # each a loss on c4
        proposed.append(proposal[1].id)
    assert proposed[-2:] == [chosen[0], chosen[2]], proposed
    assert chosen[1] not in proposed and len(proposed) == len(set(proposed))
    assert proposal[1].id.startswith("remove-"), proposal[1].id  # then the removals
    assert {chosen[0], chosen[2]} <= state.abandoned() and state.near_misses() == []  # lost on c4
    # a second near miss gives a task up just the same
    twice = [rounds[0], record(1, "c0", add[chosen[0]], 1.01), record(2, "c0", others[0], 1.2, best=True)]
    twice.append(record(3, "c2", add[chosen[0]], 1.01))
    twice = RunState.model_construct(rounds=twice, backlog=[])
    assert chosen[0] in twice.abandoned() and twice.near_misses() == []
    # one real pair has no interval (high None): its ratio decides; a controller switch is never a near
    # miss (it has its own follow-up); a task promoted on its second try is no longer one
    real = [rounds[0], record(1, "c0", add[chosen[0]], None), record(2, "c0", add[chosen[2]], None)]
    real[1].paired = Promotion(ratio=0.9, low=0.0, high=None, pairs=1)
    real[2].paired = Promotion(ratio=1.01, low=0.0, high=None, pairs=1)
    switch = Task(id="controller=static_split", title="s", rationale="r")
    real.append(record(3, "c0", switch, 1.01))
    real = RunState.model_construct(rounds=real, backlog=[])
    assert real.abandoned() == {chosen[0], switch.id} and [r.task.id for r in real.near_misses()] == [chosen[2]]
    real.rounds.append(record(4, "c0", others[0], 1.2, best=True))
    real.rounds.append(record(5, "c4", add[chosen[2]], 1.1, best=True))
    assert real.near_misses() == [] and chosen[2] not in real.abandoned()


def test_a_controller_switch_that_lost_narrowly_is_tried_once_more_on_a_later_best(tiny_spec):
    """The paper-scale search after e7d6c17: time_multiplex came out -1.4% on the starter, its follow-up
    lost, and the search went on from colocate, gaining the host tier; time_multiplex was never tried
    again, though with the tier it was 1.44x colocate. A switch that lost by at most 25% is tried once
    more on a later best, with that best's techniques, after its additions and near misses and before
    its removals; one that lost by more (the static split's -76%) is not, and a second loss gives it up."""
    from orchestrator.policies.backlog import BacklogPolicy
    from orchestrator.state import Promotion, RunState
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    p0 = starter_params(tiny_spec, "colocate")
    tier = next(t for t in planner.composition_tasks(p0) if t.id == "add-kv_host_tier")

    def record(n, parent, task, ratio, best=False):
        paired = None if ratio is None else Promotion(ratio=ratio, low=ratio, high=ratio, pairs=1, threshold=0.02)
        return _validated_round(n, parent, task, best, paired)

    def switch(name):
        return Task(id=f"controller={name}", title=f"switch to {name}", rationale="r", skills=[name])

    rounds = [
        record(0, "", Task(id="starter", title="s", rationale="r"), None, best=True),
        record(1, "c0", switch("time_multiplex"), 0.88),  # -12%: the next run's first seed
        record(2, "c0", switch("static_split"), 0.24),
        record(3, "c0", tier, 1.05, best=True),
    ]
    state = RunState.model_construct(rounds=rounds, backlog=[], best_round=3)
    p3 = {**p0, **tier.changes}
    policy, proposed = BacklogPolicy(planner, seed=0), []
    while (proposal := policy.propose(state, lambda r: p3 if r.commit == "c3" else p0)) and not (
        proposal[1].id.startswith("remove-") or proposal[1].source == "mutation"
    ):
        assert proposal[0].commit == "c3", (proposal[0].commit, proposal[1].id)
        rounds.append(record(len(rounds), "c3", proposal[1], 0.9))  # each a loss on c3
        proposed.append(proposal[1])
    ids = [t.id for t in proposed]
    assert ids[-1] == "controller=time_multiplex" and "controller=static_split" not in ids, ids
    assert all(i.startswith("add-") for i in ids[:-1]), ids  # then a removal or a move (the loop's end)
    retried = proposed[-1]
    assert retried.changes["controller"] == "time_multiplex" and planner.applies(retried, p3)
    assert {**p3, **retried.changes}["host_kv"] == p3["host_kv"] > 0  # the tier the best gained goes with it
    # lost again: given up, on this best and on any later one
    rounds.append(record(len(rounds), "c3", tier, 1.1, best=True))
    state.best_round = len(rounds) - 1
    later = f"c{len(rounds) - 1}"
    while (proposal := policy.propose(state, lambda r: p3 if r.commit in ("c3", later) else p0)) and not (
        proposal[1].id.startswith("remove-") or proposal[1].source == "mutation"
    ):
        assert not proposal[1].id.startswith("controller="), proposal[1].id
        rounds.append(record(len(rounds), later, proposal[1], 0.9))


def test_a_backlog_task_queued_under_an_earlier_best_runs_only_where_it_still_means_what_it_says(tiny_spec):
    """Hints on round 0 queued "add redundant_envs" (at 2); a later best has it on at 3. There the queued
    addition would move it back to 2 under the label "add": it is passed over, as are a move of a
    parameter of a technique that is off, a switch to the controller in use and a removal of a technique
    that is off. The policy goes on to what does apply."""
    from types import SimpleNamespace

    from orchestrator.policies.backlog import BacklogPolicy
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    p0 = starter_params(tiny_spec, "time_multiplex")
    add = {t.id: t for t in planner.composition_tasks(p0)}["add-redundant_envs"]
    best = {**p0, "redundant_envs": 3}
    kv = planner.skills["kv_routing"]
    stale = [
        add,
        planner._param_task(kv, "route_slack", 2 * kv.params["route_slack"].default, "a hint", "trigger:x", 9),
        planner._composition_task(planner.skills["tail_batching"], "remove", {"tail_round": 0}, 9),
        planner._controller_task(planner.skills["time_multiplex"], None, {"controller": "colocate"}),
    ]
    assert planner.applies(add, p0) and planner.applies(stale[1], {**p0, "kv_routing": 1})
    assert [planner.applies(t, best) for t in stale] == [False] * 4
    state = _backlog_state(SimpleNamespace(commit="c1"), backlog=stale)
    _, task = BacklogPolicy(planner, seed=0).propose(state, lambda record: best)
    assert task.id not in {t.id for t in stale} and task.source == "composition", task.id


def test_a_task_queued_from_a_rounds_findings_says_which_round_found_them(tiny_spec):
    """The backlog keeps a task for rounds after the one whose hints queued it: its rationale quoted round 0's
    "no rollout in flight for 49% of the run" beside a later parent at 14%, as if the parent's."""
    from agents.roles import Hint, Task
    from orchestrator.policies.backlog import BacklogPolicy
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    hint = Hint(code="rollout_stalls", message="no rollout in flight for 49% of the run")
    record = _validated_round(0, "", Task(id="starter", title="s", rationale="r"), True)
    record.hints = [hint]
    state = _backlog_state(record)
    BacklogPolicy(planner, seed=0).observe(state, record, starter_params(tiny_spec, "colocate"))
    assert state.backlog and all(t.rationale.startswith("round 0 found: ") for t in state.backlog), state.backlog


def test_a_parameter_step_that_gained_nothing_is_not_stepped_further_from(big_spec):
    """The paper-scale search at 36efac4: tail_idle moved tail_round 8 -> 16, within the noise; the candidate's
    own tail_idle then queued 24, taken on the best (8) as a jump, and so on to 64, seven rounds each within 1%.
    A move's findings step that parameter on only from a candidate that became the best; its other findings
    (additions, other parameters) are queued as before."""
    from agents.roles import Hint
    from orchestrator.policies.backlog import BacklogPolicy
    from skills.starter import starter_params

    planner = OfflinePlanner(big_spec, engine_devices=8, simulated=True)
    p1 = {**starter_params(big_spec, "time_multiplex"), "tail_round": 16}
    step = planner._param_task(planner.skills["tail_batching"], "tail_round", 16, "tail", "trigger:tail_idle", 8)
    hints = [Hint(code="tail_idle", message="under a quarter of the peak in flight for 30% of the run")]
    assert "tail_round=24" in {t.id for t in planner.tasks_from_hints(hints, p1)}  # the hint does step it on

    def queued(became_best: bool) -> set[str]:
        record = _validated_round(1, "c0", step, became_best)
        record.hints = hints
        state = _backlog_state(record)
        BacklogPolicy(planner, seed=0).observe(state, record, p1)
        return {t.id for t in state.backlog}

    without_gain, promoted = queued(False), queued(True)
    assert "tail_round=24" not in without_gain and "add-partial_rollout" in without_gain, without_gain
    assert "tail_round=24" in promoted, promoted


def _population(tiny_spec, *later) -> tuple:
    """A run of the starter (c0, time_multiplex) and its child (c1: tail batching added), both accepted,
    and ``later`` rounds after them, as evolve reads a state: (planner, params by commit, rounds, state)."""
    from types import SimpleNamespace

    from agents.roles import Task
    from orchestrator.state import RoundRecord
    from skills.starter import starter_params

    planner = OfflinePlanner(tiny_spec)
    p0 = starter_params(tiny_spec, "time_multiplex")
    add = {t.id: t for t in planner.composition_tasks(p0)}
    starter = Task(id="starter", title="s", rationale="r")
    rounds = [
        RoundRecord(
            round=0, task=starter, parent_round=None, parent_commit="", verdict="accepted", commit="c0", headline=1.0
        ),
        RoundRecord(
            round=1,
            task=add["add-tail_batching"],
            parent_round=0,
            parent_commit="c0",
            verdict="accepted",
            commit="c1",
            headline=1.1,
        ),
        *later,
    ]
    state = SimpleNamespace(
        rounds=rounds,
        accepted=lambda: [r for r in rounds if r.verdict == "accepted"],
        tried=lambda: {(r.parent_commit, r.task.id) for r in rounds},
    )
    return planner, {"c0": p0, "c1": {**p0, **add["add-tail_batching"].changes}}, rounds, state


def test_evolve_ends_only_when_no_member_of_its_population_has_a_new_mutation(tiny_spec):
    """The tournament never draws the least fit: with the starter and one child, only the child was mutated,
    and once it had nothing new the run ended with 16 new compositions left on the starter. A random
    parameter move was drawn from all moves, then checked for novelty: with one new move of seven, the run
    ended one time in fifty."""
    from orchestrator.policies.evolve import EvolvePolicy
    from orchestrator.state import RoundRecord

    planner, params, rounds, state = _population(tiny_spec)
    p0, p1 = params["c0"], params["c1"]
    every = planner.composition_tasks(p1) + planner.parameter_moves(p1) + planner.tasks_from_hints([], p1)
    for i, task in enumerate({t.id: t for t in every}.values()):  # everything from the child tried
        rounds.append(RoundRecord(round=2 + i, task=task, parent_round=1, parent_commit="c1", verdict="rejected"))
    for seed in range(20):
        parent, task = EvolvePolicy(planner, seed).propose(state, lambda r: params[r.commit])
        assert parent.commit == "c0" and ("c0", task.id) not in state.tried()
    # one parameter move left of the child's, every other mutation tried: found every time
    moves = planner.parameter_moves(p1)
    rounds[2:] = [
        RoundRecord(round=2 + i, task=t, parent_round=1, parent_commit="c1", verdict="rejected")
        for i, t in enumerate(every)
        if t.id != moves[-1].id
    ] + [
        RoundRecord(round=99, task=t, parent_round=0, parent_commit="c0", verdict="rejected")
        for t in planner.composition_tasks(p0) + planner.parameter_moves(p0)
    ]
    for seed in range(100):
        parent, task = EvolvePolicy(planner, seed).propose(state, lambda r: params[r.commit])
        assert (parent.commit, task.id) not in state.tried()


def test_evolve_by_pareto_draws_its_parents_from_the_front_of_goodput_and_trained_tokens(tiny_spec):
    """With ``selection="pareto"`` a parent is drawn from the members no other beats in both the headline and
    the trained tokens a second: c1 (the best goodput, from short trajectories) and c2 (the most tokens), never
    c0 or c3, which c1 or c2 dominates; the tournament on the headline alone draws c2 only when it is one of
    two drawn with a weaker member, and never the front's point of view."""
    from orchestrator.policies.evolve import EvolvePolicy, fitness, pareto_front
    from orchestrator.state import RoundRecord

    planner, params, rounds, state = _population(tiny_spec)
    rounds[0].metrics, rounds[1].metrics = {"trained_tokens_per_s": 100.0}, {"trained_tokens_per_s": 90.0}
    for commit, headline, tokens in (("c2", 1.05, 140.0), ("c3", 1.0, 130.0)):
        rounds.append(
            RoundRecord(
                round=len(rounds),
                task=rounds[1].task.model_copy(update={"id": f"t-{commit}"}),
                parent_round=0,
                parent_commit="c0",
                verdict="accepted",
                commit=commit,
                headline=headline,
                metrics={"trained_tokens_per_s": tokens},
            )
        )
        params[commit] = params["c1"]
    assert [r.commit for r in pareto_front(state.accepted(), fitness(state, 1))] == ["c1", "c2"]
    assert [r.commit for r in pareto_front(state.accepted(), fitness(state, -1))] == ["c2", "c3"]  # lower wins
    drawn = {EvolvePolicy(planner, seed, "pareto")._select(state).commit for seed in range(40)}
    assert drawn == {"c1", "c2"}
    by_fitness = {EvolvePolicy(planner, seed)._select(state).commit for seed in range(40)}
    assert "c0" in by_fitness or "c3" in by_fitness  # the tournament draws dominated members too


def test_evolve_ranks_its_members_by_their_paired_ratios_not_headlines_from_other_seeds(tiny_spec):
    """Each round's headline is the median over its own seeds, which change every round: c1 drew an easy
    workload (50 against the starter's 40) but measured beside the starter on its seeds it was 10% slower.
    The tournament drew c1 over the starter; fitness now chains the paired ratios (c2, 1.2x its best c0,
    and c3, 1.1x c2 once c2 was best, rank c3 > c2 > c0 > c1 whatever their headlines)."""
    from orchestrator.policies.evolve import EvolvePolicy, fitness
    from orchestrator.state import Promotion, RoundRecord

    planner, params, rounds, state = _population(tiny_spec)
    rounds[0] = rounds[0].model_copy(update={"headline": 40.0, "became_best": True})
    pair = lambda ratio: Promotion(ratio=ratio, low=ratio - 0.05, high=ratio + 0.05, pairs=3)  # noqa: E731
    rounds[1] = rounds[1].model_copy(update={"headline": 50.0, "paired": pair(0.9)})
    for n, headline, ratio, best in ((2, 30.0, 1.2, True), (3, 35.0, 1.1, False)):
        task = rounds[1].task.model_copy(update={"id": f"t-{n}"})
        rounds.append(
            RoundRecord(
                round=n,
                task=task,
                parent_round=0,
                parent_commit="c0",
                verdict="accepted",
                commit=f"c{n}",
                headline=headline,
                paired=pair(ratio),
                became_best=best,
            )
        )
        params[f"c{n}"] = params["c1"]
    fit = fitness(state, 1)
    assert fit == pytest.approx({0: 1.0, 1: 0.9, 2: 1.2, 3: 1.32})
    for seed in range(30):  # c0 beside c1, whichever two are drawn: the fitter by the pairs
        policy = EvolvePolicy(planner, seed)
        policy.rng.sample = lambda population, k: [rounds[0], rounds[1]]
        assert policy._select(state).commit == "c0"


def test_evolve_proposes_the_same_round_whether_the_run_was_resumed_or_not(tiny_spec):
    """Its generator lived in memory only, rebuilt from the seed on --resume: for 13 of 30 seeds round 2
    was another task after a resume than without one (a round redone after a failing environment was
    another round)."""
    from agents.offline.planner import OfflinePlanner
    from orchestrator.policies.evolve import EvolvePolicy
    from orchestrator.state import RoundRecord

    _, params, rounds, state = _population(tiny_spec)
    p0 = params["c0"]
    for seed in range(30):
        del rounds[1:]  # the starter alone
        running = EvolvePolicy(OfflinePlanner(tiny_spec, seed=seed), seed)
        _, first = running.propose(state, lambda r: p0)
        rounds.append(RoundRecord(round=1, task=first, parent_round=0, parent_commit="c0", verdict="rejected"))
        _, second = running.propose(state, lambda r: p0)
        _, resumed = EvolvePolicy(OfflinePlanner(tiny_spec, seed=seed), seed).propose(state, lambda r: p0)
        assert second.id == resumed.id, seed


def test_evolve_never_rebuilds_a_configuration_the_run_already_tried(tiny_spec):
    """Novelty: removing the technique a child added rebuilds its parent, and adding a technique the run
    already tried (and rejected) from the parent is the same point; evolve proposes neither, for any seed."""
    from orchestrator.policies.evolve import EvolvePolicy
    from orchestrator.policies.novelty import near_duplicates
    from orchestrator.state import RoundRecord

    add = {t.id: t for t in OfflinePlanner(tiny_spec).composition_tasks(_population(tiny_spec)[1]["c0"])}
    rejected = RoundRecord(
        round=2, task=add["add-overlap_sync"], parent_round=0, parent_commit="c0", verdict="rejected"
    )
    planner, params, rounds, state = _population(tiny_spec, rejected)
    p0, p1 = params["c0"], params["c1"]
    built = [p0, p1, {**p0, **add["add-overlap_sync"].changes}]
    # the planner does offer the duplicates: undoing round 1 from c1, round 2's technique from c1 is new
    assert any(near_duplicates({**p1, **t.changes}, p0) for t in planner.composition_tasks(p1))
    proposals = []
    for seed in range(40):
        proposal = EvolvePolicy(planner, seed).propose(state, lambda record: params[record.commit])
        assert proposal is not None
        parent, task = proposal
        child = {**params[parent.commit], **task.changes}
        assert not any(near_duplicates(child, b) for b in built), (parent.commit, task.id)
        proposals.append((parent.commit, task.id))
    assert len(set(proposals)) > 3  # still a search, not one fixed move
    # the backlog too: from c1, undoing its technique (a task the backlog holds) would rebuild c0
    from orchestrator.policies.backlog import BacklogPolicy

    undo = next(t for t in planner.composition_tasks(p1) if t.id == "remove-tail_batching")
    state.best, state.backlog, state.abandoned, state.near_misses = rounds[1], [undo], lambda: set(), lambda: []
    parent, task = BacklogPolicy(planner, 0).propose(state, lambda record: params[record.commit])
    assert task.id != undo.id and not any(near_duplicates({**p1, **task.changes}, b) for b in built)
    assert EvolvePolicy(planner, 7).propose(state, lambda r: params[r.commit])[1].id == proposals[7][1]  # seeded
    assert near_duplicates({"x": 1.0, "n": 4}, {"x": 1.05, "n": 4}) and not near_duplicates({"x": 1.0}, {"x": 1.2})
    assert not near_duplicates({"n": 4}, {"n": 5}) and not near_duplicates({"x": 1.0}, {"x": 1.0, "y": 0})
    # a parameter left out counts at its default where one is known: async_ratio 0 then back to 1 (the target's
    # own bound, which params.json leaves out) rebuilt the grandparent unseen
    assert near_duplicates({"x": 1.0}, {"x": 1.0, "y": 0}, lambda name: 0)
    assert near_duplicates(p0, {**p0, "async_ratio": tiny_spec.workload.async_ratio}, planner.default)


def _event(kind, t, **data):
    return TraceEvent(kind, t, data)


def test_hints_read_stalls_and_the_tail_from_the_trace():
    events = [_event("run_start", 0.0, devices=["cpu:0"])]
    events += [_event("generate", 1.0, start=0.0, aborted=False, device="cpu:0") for _ in range(8)]  # 8 in flight, then
    events += [_event("generate", 2.0, start=1.0, aborted=False, device="cpu:0")]  # a tail of one, then nothing
    events += [_event("run_end", 4.0)]
    stalled, tail = concurrency_shares(events)
    assert stalled == pytest.approx(0.5) and tail == pytest.approx(0.25)
    metrics = {
        "mean_device_busy": 0.5,
        "device_utilization": {"cpu:0": {"train": 0.0, "idle": 0.5}},
        "timeout_ratio": 0.0,
        "lost_ratio": 0.0,
        "checkpoint_s": 0.0,
        "aborted_turns": 0,
        "sync_s": 0.0,
        "duration_s": 4.0,
    }
    assert {h.code for h in hints_from(metrics, events, simulated=True)} == {
        "rollout_stalls",
        "tail_idle",
        "devices_idle",
    }


def _busy_run_metrics() -> dict:
    """A 4-second run's metrics that give no finding of their own (busy devices, no timeouts, aborts or sync)."""
    return {
        "mean_device_busy": 0.9,
        "device_utilization": {},
        "timeout_ratio": 0.0,
        "lost_ratio": 0.0,
        "checkpoint_s": 0.0,
        "aborted_turns": 0,
        "sync_s": 0.0,
        "duration_s": 4.0,
    }


def test_stale_drops_hint_the_early_abort(tiny_spec):
    """One in ten episodes dropped as stale is a finding; the planner answers it with abort_stale and
    tail batching (and a looser bound where the target allows one)."""
    events = [_event("run_start", 0.0, devices=["cpu:0"]), _event("run_end", 4.0)]
    events += [_event("episode_created", 0.0, episode=f"e{i}", group="g") for i in range(10)]
    events += [_event("sample_dropped", 3.0, episode="e0", reason="stale")]
    metrics = _busy_run_metrics()
    hints = [h for h in hints_from(metrics, events, simulated=True) if h.code == "stale_drops"]
    assert len(hints) == 1 and hints[0].evidence == {"stale_drops": 1, "episodes": 10}
    tasks = OfflinePlanner(tiny_spec).tasks_from_hints(hints, {"controller": "time_multiplex", "train_devices": 1})
    assert [t.changes for t in tasks] == [{"abort_stale": 1}, {"tail_round": 8}]
    limit = tiny_spec.workload.async_ratio + 1
    looser = tiny_spec.model_copy(update={"workload": tiny_spec.workload.model_copy(update={"max_async_ratio": limit})})
    tasks = OfflinePlanner(looser).tasks_from_hints(hints, {"controller": "time_multiplex", "train_devices": 1})
    assert {"async_ratio": tiny_spec.workload.async_ratio + 1} in [t.changes for t in tasks]
    events[-1] = _event("sample_dropped", 3.0, episode="e0", reason="end_of_run")
    assert not [h for h in hints_from(metrics, events, simulated=True) if h.code == "stale_drops"]


def test_rollout_on_devices_of_several_kinds_hints_hardware_affinity_which_only_mixed_targets_get(tiny_spec):
    """Turns served on an H20 and an H800 are the ``mixed_kinds`` finding; the planner answers it with
    hardware_affinity, which it never proposes (by hint or by composition) where devices are of one kind."""
    events = [_event("run_start", 0.0, devices=["h20:0", "h800:0"]), _event("run_end", 4.0)]
    events += [_event("generate", 1.0, start=0.0, aborted=False, device=d) for d in ("h20:0", "h800:0", "h20:0")]
    metrics = _busy_run_metrics()
    kinds = {"h20:0": "h20", "h800:0": "h800"}
    hints = [h for h in hints_from(metrics, events, simulated=True, kinds=kinds) if h.code == "mixed_kinds"]
    assert len(hints) == 1 and hints[0].evidence == {"turns_by_kind": {"h20": 2, "h800": 1}}
    assert not [h for h in hints_from(metrics, events, simulated=True, kinds={}) if h.code == "mixed_kinds"]
    _answered_only_where_it_applies(
        tiny_spec, "qwen3-8b-h20x8-h800x8", hints, "hardware_affinity", {"affinity_ratio": 8.0}
    )
    # nor on a mixed target whose controller rolls out on one kind (a static split's H20s): the router
    # would refuse it at build
    mixed = OfflinePlanner(load_target("qwen3-8b-h20x8-h800x8"), simulated=True)
    split = {"controller": "static_split", "rollout_devices": 8, "train_devices": 8}
    assert not mixed.tasks_from_hints(hints, split)
    assert "add-hardware_affinity" not in [t.id for t in mixed.composition_tasks(split)]
    assert mixed.fits({**split, "rollout_devices": 9, "train_devices": 7, "affinity_ratio": 8.0})


def _answered_only_where_it_applies(tiny_spec, target: str, hints, skill: str, changes: dict) -> None:
    """The planner answers ``hints`` by switching ``skill`` on (``changes``) on ``target``, by hint and
    by composition, and proposes it neither way on the tiny target, where it does not apply."""
    params = {"controller": "time_multiplex", "train_devices": 8}
    where = OfflinePlanner(load_target(target), simulated=True)
    assert [t.changes for t in where.tasks_from_hints(hints, params)] == [changes]
    assert f"add-{skill}" in [t.id for t in where.composition_tasks(params)]
    single = OfflinePlanner(tiny_spec)
    params = {"controller": "time_multiplex", "train_devices": 1}
    assert not single.tasks_from_hints(hints, params)
    assert f"add-{skill}" not in [t.id for t in single.composition_tasks(params)]


@pytest.mark.parametrize("share", [0.47, 0.25])
def test_engines_prefilling_a_fifth_of_their_time_hint_the_host_tier(share):
    """Engines that spent over 20% of their busy time prefilling (an earlier paper-scale best: 47%;
    time_multiplex after e7d6c17: 25%, which the tier took to 6.6% for 1.44x colocate, and which the 30% bar
    left unanswered) are the ``prefill_bound`` finding; the planner answers it with kv_host_tier on a
    simulated target."""
    events = [_event("run_start", 0.0, devices=["h800:0"]), _event("run_end", 4.0)]
    metrics = _busy_run_metrics() | {"prefill_share": share, "prefilled_tokens": 9e8}
    hints = [h for h in hints_from(metrics, events, simulated=True) if h.code == "prefill_bound"]
    assert len(hints) == 1 and hints[0].evidence == {"prefill_share": share, "prefilled_tokens": 9e8}
    assert f"{share:.0%} of their busy time prefilling" in hints[0].message
    calm = _busy_run_metrics() | {"prefill_share": 0.1, "prefilled_tokens": 1e8}
    assert not [h for h in hints_from(calm, events, simulated=True) if h.code == "prefill_bound"]
    planner = OfflinePlanner(load_target("qwen3-235b-a22b-h800x160"), simulated=True)
    params = {"controller": "time_multiplex", "train_devices": 128}
    assert [t.changes for t in planner.tasks_from_hints(hints, params)] == [{"host_kv": 16}]


def test_lost_episodes_hint_env_checkpoint_which_only_targets_with_stateful_environments_get(tiny_spec):
    """Trajectories lost with their environment's state are the ``lost_episodes`` finding; the planner
    answers it with env_checkpoint, which it never proposes where crashes lose nothing."""
    events = [_event("run_start", 0.0, devices=["h800:0"]), _event("run_end", 4.0)]
    metrics = _busy_run_metrics() | {"lost_ratio": 0.15}
    hints = [h for h in hints_from(metrics, events, simulated=True) if h.code == "lost_episodes"]
    assert len(hints) == 1 and hints[0].evidence == {"lost_ratio": 0.15, "checkpoint_s": 0.0}
    assert not [h for h in hints_from(_busy_run_metrics(), events, simulated=True) if h.code == "lost_episodes"]
    _answered_only_where_it_applies(
        tiny_spec, "qwen3-8b-h800x16-sandbox", hints, "env_checkpoint", {"checkpoint_level": 1}
    )


def test_a_serving_pool_with_headroom_hints_serving_harvest_which_only_targets_beside_one_get(tiny_spec):
    """A serving pool whose p99 TTFT stayed well under its SLO is the ``serving_headroom`` finding; the
    planner answers it with serving_harvest, which it never proposes where no serving pool is."""
    events = [_event("run_start", 0.0, devices=["h800:0"]), _event("run_end", 4.0)]
    record = {"ttft_p99_s": 0.1, "ttft_slo_s": 0.5, "devices": ["serving:0", "serving:1"]}
    events.insert(1, _event("serving", 4.0, **record))
    metrics = _busy_run_metrics() | {"lent_devices": 0.0}
    hints = [h for h in hints_from(metrics, events, simulated=True) if h.code == "serving_headroom"]
    assert len(hints) == 1 and hints[0].evidence == {"ttft_p99_s": 0.1, "lent_devices": 0.0}
    events[1] = _event("serving", 4.0, **{**record, "ttft_p99_s": 0.45})  # near its SLO: no room
    assert not [h for h in hints_from(metrics, events, simulated=True) if h.code == "serving_headroom"]
    _answered_only_where_it_applies(
        tiny_spec, "qwen3-8b-h800x16-serving", hints, "serving_harvest", {"serving_harvest": 1}
    )


def test_a_judge_beside_the_policy_or_idle_on_its_own_devices_hints_reward_placement_where_a_service_is(tiny_spec):
    """A reward model colocated with rollout, or on dedicated devices mostly idle, is the
    ``judge_placement`` finding; the planner answers it with reward_placement (serverless), which it
    never proposes where the target's judge offers no serverless service."""
    events = [_event("run_start", 0.0, devices=["h800:0"]), _event("run_end", 4.0)]
    metrics = _busy_run_metrics() | {"reward_verdict_s": 3.0}
    record = {"where": "colocated", "scored": 10, "instances": 0, "device_s": 0.0, "busy_s": 0.0, "utilization": 0.0}
    events.insert(1, _event("reward_service", 4.0, **record))
    hints = [h for h in hints_from(metrics, events, simulated=True) if h.code == "judge_placement"]
    assert len(hints) == 1 and hints[0].evidence == {"where": "colocated", "busy": 0.0, "verdict_s": 3.0}
    idle = {**record, "where": "dedicated", "instances": 4, "device_s": 400.0, "busy_s": 40.0, "utilization": 0.1}
    events[1] = _event("reward_service", 4.0, **idle)  # its own devices idle most of the time they are held
    found = [h for h in hints_from(metrics, events, simulated=True) if h.code == "judge_placement"]
    assert len(found) == 1 and found[0].evidence["busy"] == 0.1 and "busy 10%" in found[0].message
    busy = {**record, "where": "serverless", "instances": 2, "device_s": 100.0, "busy_s": 90.0, "utilization": 0.9}
    events[1] = _event("reward_service", 4.0, **busy)  # its own devices busy most of the time they are held
    assert not [h for h in hints_from(metrics, events, simulated=True) if h.code == "judge_placement"]
    _answered_only_where_it_applies(
        tiny_spec, "qwen3-8b-h800x16-judge", hints, "reward_placement", {"reward_placement": 2}
    )


@pytest.fixture(scope="module")
def big_spec():
    return load_target("qwen3-235b-a22b-h800x160")


# -- the sandbox ----------------------------------------------------------------------------------


def test_the_environment_loses_its_secrets():
    env = scrubbed_environment(
        {"PATH": "/bin", "OPENAI_API_KEY": "sk-x", "ANTHROPIC_API_KEY": "a", "MY_TOKEN": "t", "LANG": "C"}
    )
    assert set(env) == {"PATH", "LANG", "VIBETRAIN_CACHE"}


def test_a_ray_cluster_address_reaches_only_a_sandbox_with_the_network(caplog, monkeypatch):
    """``RAY_ADDRESS``: the subprocess sandbox's candidates join that cluster (without a token: no secret
    passes); bubblewrap's have no network, so theirs start their own, and the log says so."""
    env = {"PATH": "/bin", "RAY_ADDRESS": "127.0.0.1:6380", "RAY_AUTH_TOKEN": "t"}
    _, plain = Sandbox("subprocess").wrap(["true"], env)
    assert plain["RAY_ADDRESS"] == "127.0.0.1:6380" and plain["RAY_AUTH_MODE"] == "disabled"
    assert "RAY_AUTH_TOKEN" not in plain
    assert "RAY_ADDRESS" not in Sandbox("subprocess").wrap(["true"], {"PATH": "/bin"})[1]
    monkeypatch.setattr("targets.harness.isolation.sandbox._announced", set())  # said once a process
    with caplog.at_level("WARNING", logger="vibetrain.sandbox"):
        command, _ = Sandbox("bubblewrap").wrap(["true"], env)
    assert "RAY_ADDRESS=" not in " ".join(command) and "127.0.0.1:6380" not in command
    assert "candidates start a Ray cluster of their own" in caplog.text


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


@needs_bwrap
def test_bubblewrap_keeps_writes_in_the_workspace_and_has_no_network(tmp_path):
    sandbox = Sandbox.detect("bubblewrap")
    workspace, out = tmp_path / "ws", tmp_path / "out"
    workspace.mkdir(), out.mkdir()
    outside = Path.home() / f"vibetrain-sandbox-probe-{os.getpid()}"
    probe = (
        "import pathlib, socket, sys\n"
        f"pathlib.Path('{workspace}/ok').write_text('in')\n"
        "try:\n"
        f"    pathlib.Path('{outside}').write_text('out'); print('WROTE-OUTSIDE')\n"
        "except OSError as e: print('outside refused', e.errno)\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=2); print('NETWORK')\n"
        "except OSError: print('no network')\n"
        "import os; print('KEY' if 'OPENAI_API_KEY' in os.environ else 'no key')\n"
    )
    command, env = sandbox.wrap(
        [sys.executable, "-c", probe], {**os.environ, "OPENAI_API_KEY": "sk-secret"}, writable=[workspace, out]
    )
    result = subprocess.run(command, env=env or None, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "outside refused" in result.stdout and "no network" in result.stdout and "no key" in result.stdout
    assert (workspace / "ok").read_text() == "in" and not outside.exists()


@needs_bwrap
def test_bubblewrap_drops_every_capability_and_shows_no_run_folder_nor_the_working_directory(tmp_path, monkeypatch):
    """Run as root, the sandbox kept every capability: a candidate remounted its read-only binds (the
    virtualenv, the model cache, the checkout) writable. The checkout's runs and worktrees and its git,
    and the working directory Python puts on sys.path (a home, say), were visible to it."""
    from targets import PROJECT_ROOT

    home = tmp_path / "home"
    home.mkdir()
    (home / ".npmrc").write_text("token")
    monkeypatch.chdir(home)
    monkeypatch.syspath_prepend(str(home))
    own = PROJECT_ROOT / "workspaces" / f"round-probe-{os.getpid()}"  # where generate puts a judged stack
    other = PROJECT_ROOT / "workspaces" / f"round-other-{os.getpid()}"
    for folder in (own, other):
        (folder / "stack").mkdir(parents=True, exist_ok=True)
        (folder / "stack" / "secret.py").write_text("x = 1\n")
    dotenv = PROJECT_ROOT / f".env.probe-{os.getpid()}"  # a red team's sandboxed command printed a .env's key
    dotenv.write_text("OPENAI_API_KEY=sk-planted\n")
    notes = PROJECT_ROOT / f"notes-probe-{os.getpid()}.txt"  # a key kept beside the code under any other name
    notes.write_text("ANTHROPIC_API_KEY=sk-noted\n")
    probe = (
        "import os, pathlib, subprocess, sys\n"
        "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
        "print('caps', int(caps, 16))\n"
        f"print('home', pathlib.Path('{home / '.npmrc'}').exists())\n"
        f"git = pathlib.Path('{PROJECT_ROOT / '.git'}')\n"
        "print('git', sorted(os.listdir(git)) if git.is_dir() else None)\n"
        f"print('workspaces', sorted(os.listdir('{PROJECT_ROOT / 'workspaces'}')))\n"
        f"print('own', pathlib.Path('{own / 'stack' / 'secret.py'}').exists())\n"
        f"for name, path in (('dotenv', '{dotenv}'), ('notes', '{notes}')):\n"
        "    try:\n        print(name, repr(pathlib.Path(path).read_text()))\n"
        "    except (PermissionError, FileNotFoundError) as error:\n        print(name, type(error).__name__)\n"
        f"print('checkout', sorted(os.listdir('{PROJECT_ROOT}')))\n"
        "import targets.api\n"
        "remount = subprocess.run(['mount', '-o', 'remount,bind,rw', sys.prefix], capture_output=True)\n"
        "print('remount', remount.returncode)\n"
        "print('sysctl', os.access('/proc/sys/kernel/core_pattern', os.W_OK))\n"
    )
    try:
        command, env = Sandbox.detect("bubblewrap").wrap(
            [sys.executable, "-c", probe], dict(os.environ), readable=[own]
        )
        result = subprocess.run(command, env=env or None, capture_output=True, text=True, timeout=60, cwd=home)
    finally:
        shutil.rmtree(own)
        shutil.rmtree(other)
        dotenv.unlink()
        notes.unlink()
    assert result.returncode == 0, result.stderr
    said = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    # of the checkout, the contract and the harness's candidate side alone (and its worktree, below)
    assert "sk-" not in result.stdout and said["dotenv"] == said["notes"] == "FileNotFoundError", result.stdout
    shown = set(ast.literal_eval(said["checkout"])) - {"tests"}  # pytest puts tests/ on sys.path: an import path
    assert shown == {"targets", "workspaces"}, result.stdout
    assert said["caps"] == "0" and said["remount"] != "0", result.stdout
    assert said["sysctl"] == "False", result.stdout  # run as root, /proc/sys stayed writable: core_pattern's pipe
    assert said["home"] == "False" and said["git"] in ("[]", "None"), result.stdout
    # its own stack, inside the checkout's worktrees, is there; another round's is not
    assert said["own"] == "True" and said["workspaces"] == f"['{own.name}']", result.stdout


@needs_bwrap
def test_bubblewrap_sizes_its_memory_backed_folders_and_keeps_dev_read_only(tmp_path):
    """/tmp and /dev/shm are tmpfs, memory no process's resident set counts, each up to half the host's by
    default: a candidate held gigabytes there past the watchdog. /dev itself was writable too."""
    probe = (
        "import os\n"
        "for folder in ('/tmp', '/dev/shm'):\n"
        "    try:\n"
        "        with open(folder + '/fill', 'wb') as f:\n"
        "            for _ in range(16): f.write(b'x' * (1 << 20))\n"
        "        print(folder, 'FILLED')\n"
        "    except OSError as error: print(folder, 'full', error.errno)\n"
        "try: open('/dev/evil', 'w'); print('/dev WRITABLE')\n"
        "except OSError as error: print('/dev read-only', error.errno)\n"
    )
    command, env = Sandbox.detect("bubblewrap").wrap(
        [sys.executable, "-c", probe], dict(os.environ), memory_bytes=8 << 20
    )
    result = subprocess.run(command, env=env or None, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["/tmp full 28", "/dev/shm full 28", "/dev read-only 30"], result.stdout


# -- the harness's watchdog: limits a candidate cannot outrun --------------------------------------


def _planted_build(tmp_path, tiny_spec, code: str) -> Path:
    stack = write_starter(tmp_path / "s", tiny_spec, "static_split")
    build = stack / "stack" / "build.py"
    build.write_text(
        build.read_text().replace(
            "def build(runtime: Runtime) -> Stack:\n", "def build(runtime: Runtime) -> Stack:\n" + code
        )
    )
    return stack


@pytest.mark.slow
def test_a_candidate_that_eats_memory_is_killed_at_its_limit(tmp_path, tiny_spec):
    stack = _planted_build(
        tmp_path,
        tiny_spec,
        "    import time\n    hog = [bytearray(64 << 20) for _ in range(64)]  # planted: 4 GB\n"
        "    time.sleep(60)  # held until the watchdog sees it (it samples every 0.25 s)\n",
    )
    run = run_harness(
        Target.load("tiny-qwen3-cpu"),
        stack,
        tmp_path / "out",
        "accuracy",
        Limits(time_s=120, memory_mb=1500),
        Sandbox("subprocess"),
    )
    assert not run.ok and "over its limit of 1500 MB" in run.cause, run.cause


_SHARED_300_MB = (  # four processes sharing one 300 MB block copy-on-write (as GPU processes share CUDA)
    "import os, sys, time\n"
    "block = bytearray(300 << 20)\n"
    "for i in range(0, len(block), 4096): block[i] = 1\n"
    "first = os.getpid()\n"
    "os.fork()\n"
    "os.fork()\n"
    "if os.getpid() == first: print('ready', flush=True)\n"  # one writer: the lines cannot interleave
    "time.sleep(30)\n"
)


@contextlib.contextmanager
def _sharing_tree():
    from targets.harness.isolation.process_tree import kill_tree

    holder = subprocess.Popen([sys.executable, "-c", _SHARED_300_MB], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        yield holder
    finally:
        kill_tree(holder.pid)
        holder.wait()


def test_memory_shared_by_forked_processes_counts_once():
    """The limit counts proportional set sizes: four processes sharing 300 MB (as GPU processes share
    their CUDA libraries) hold 300 MB, not 1.2 GB. The watchdog's cheap bound (resident set sizes)
    counts 1.2 GB, and it is only a bound from above."""
    from targets.harness.isolation.process_tree import process_tree, resident_bound_mb, resident_mb

    with _sharing_tree() as holder:
        tree = process_tree(holder.pid)
        assert len(tree) == 4, tree
        assert 300 < resident_mb(tree) < 500, resident_mb(tree)
        assert resident_bound_mb(tree) > 1200, resident_bound_mb(tree)


@pytest.mark.parametrize("limit_mb, killed_for", [(800, "time limit"), (200, "over its limit of 200 MB")])
def test_the_watchdog_decides_on_proportional_sizes_when_resident_sizes_pass_the_limit(limit_mb, killed_for):
    """Past the cheap bound (1.2 GB of resident set sizes) the watchdog looks closer: the tree's 300 MB
    of proportional sizes is within 800 MB (the run goes on until its time limit), over 200 MB."""
    from targets.harness.isolation.launch import _watch

    read_fd, write_fd = os.pipe()
    exits_fd, exits_write_fd = os.pipe()  # no exit is said: the holder outlives the watch
    try:
        with _sharing_tree() as holder:
            why = _watch(holder, Limits(time_s=2.0, memory_mb=limit_mb), read_fd, exits_fd, {}, [], [])
    finally:
        for fd in (read_fd, write_fd, exits_fd, exits_write_fd):
            os.close(fd)
    assert killed_for in why, why


def test_a_thread_storm_is_killed_at_its_limit():
    """The watchdog counted processes, not threads: 400 threads in one process passed as one."""
    from targets.harness.isolation.launch import _watch
    from targets.harness.isolation.process_tree import kill_tree

    storm = "import threading, time\nfor _ in range(60): threading.Thread(target=time.sleep, args=(30,)).start()\n"
    holder = subprocess.Popen([sys.executable, "-c", storm + "print('ready', flush=True)"], stdout=subprocess.PIPE)
    read_fd, write_fd = os.pipe()
    exits_fd, exits_write_fd = os.pipe()
    try:
        assert holder.stdout.readline().strip() == b"ready"
        why = _watch(holder, Limits(time_s=5.0, threads=50), read_fd, exits_fd, {}, [], [])
    finally:
        kill_tree(holder.pid)
        holder.wait()
        for fd in (read_fd, write_fd, exits_fd, exits_write_fd):
            os.close(fd)
    assert "61 threads, over its limit of 50 (a thread storm?)" in why, why


@pytest.mark.slow
def test_a_candidate_that_forks_a_storm_is_killed(tmp_path, tiny_spec):
    token = f"storm-{uuid.uuid4().hex}"  # pgrep finds this test's processes only, not another run's on the machine
    code = (
        "    import subprocess, sys\n"
        f"    kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])"
        " for _ in range(40)]  # planted\n"
        "    time.sleep(60)\n"
    )
    stack = _planted_build(tmp_path, tiny_spec, "    import time\n" + code)
    run = run_harness(
        Target.load("tiny-qwen3-cpu"),
        stack,
        tmp_path / "out",
        "accuracy",
        Limits(time_s=120, processes=20),
        Sandbox("subprocess"),
    )
    assert not run.ok and "processes, over its limit of 20" in run.cause, run.cause
    leftovers = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout.split()
    assert leftovers == [], "the storm outlived the kill"


def test_a_killed_run_is_waited_for_until_its_processes_are_gone():
    """A SIGKILL acts when its process next runs: the watchdog waits for the killed (a zombie has
    exited) and names what is still running at its deadline, found by pid or by process group."""
    from targets.harness.isolation.process_tree import wait_exited

    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert wait_exited([sleeper.pid], [], 0.05) == [sleeper.pid]
        assert wait_exited([], [sleeper.pid], 0.05) == [sleeper.pid]  # a member of the group
        os.kill(sleeper.pid, signal.SIGKILL)
        assert wait_exited([sleeper.pid], [sleeper.pid], 5) == []  # not yet reaped: a zombie, gone
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_sandbox_sees_the_project_even_when_it_is_not_on_sys_path():
    """An editable install's import finder points at the checkout without putting it on sys.path; a
    checkout under /tmp (as CI's clean clone may be) must still be bound into the sandbox."""
    from targets.harness.isolation import sandbox

    project = Path(sandbox.__file__).resolve().parents[3]
    assert (project / "pyproject.toml").exists() and project / "targets" in sandbox.python_paths()
    assert project not in [path.resolve() for path in sandbox.python_paths()]  # nor the rest of the checkout
    assert sandbox.outermost([Path("/tmp"), Path("/")]) == []  # /tmp itself is the sandbox's own


def test_the_dependency_direction_holds_agents_and_targets_never_import_the_orchestrator():
    """DESIGN §2: orchestrator -> agents -> targets, skills; targets imports neither agents nor the
    orchestrator. Read from every import statement of the packages."""
    import ast

    root = Path(__file__).resolve().parent.parent
    forbidden = {"agents": {"orchestrator"}, "targets": {"orchestrator", "agents"}, "skills": {"orchestrator"}}
    found = []
    for package, banned in forbidden.items():
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found += [
                    f"{path.relative_to(root)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in banned
                ]
    assert found == []


def test_the_first_switch_is_the_controller_that_answers_most(tiny_spec):
    """The main job has two rounds after the starter: the switch the library expects to pay most comes
    first. A stalled colocate rollout is answered by both the static split and time-multiplexing; the
    latter answers more kinds of finding (idle devices and tails), so it goes first."""
    from skills.starter import starter_params

    colocate = starter_params(tiny_spec, "colocate")
    planner = OfflinePlanner(tiny_spec)
    stalls = Hint(code="rollout_stalls", message="no rollout in flight for 35% of the run")
    assert [t.id for t in planner.tasks_from_hints([stalls], colocate)][:2] == [
        "controller=time_multiplex",
        "controller=static_split",
    ]
    tail = Hint(code="tail_idle", message="tail")
    ranked = {t.id: t.priority for t in planner.tasks_from_hints([stalls, tail], colocate)}
    assert ranked["controller=time_multiplex"] > ranked["controller=static_split"]  # it answers both findings
