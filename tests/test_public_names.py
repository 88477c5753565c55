"""The names users import: tessera.config, tessera.trainer, tessera.cli and tessera.testing are modules of
their own, the objects that run. The runtime's names from before milestone 4's split (tessera.run,
tessera.bench, ...) are gone (docs/repository.md's release note names where each lives now)."""

from __future__ import annotations

import gc
import importlib
import os
import subprocess
import sys
from unittest import mock

import pytest

import tessera


@pytest.mark.parametrize("old", ["tessera.run", "tessera.bench", "tessera.memtrack", "tessera.pytest_plugin"])
def test_an_old_module_name_is_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_public_names_are_the_objects_that_run():
    from tessera.cli import build_parser, main
    from tessera.commands import main as command
    from tessera.config import Config
    from tessera.testing import assert_layouts_equivalent
    from tessera.testing import equivalence
    from tessera.trainer import Trainer
    from tessera.training import run_config, training_loop

    assert Config is run_config.Config and Trainer is training_loop.Trainer
    assert main is command.main and build_parser is command.build_parser
    assert assert_layouts_equivalent is equivalence.assert_layouts_equivalent


def test_an_unknown_name_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tessera.no_such_module")


def test_the_pytest_plugin_loads_no_torch():
    # pytest loads the plugin in every session of a machine where tessera is installed
    code = "import sys, tessera.testing.pytest_plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_python_m_tessera_cli_is_the_command():
    out = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert tessera.__version__ in out.stdout


def test_tessera_train_starts_the_rank_server_with_the_launchers_imports_and_no_torch_of_its_own(tmp_path):
    from tessera.launching import launch
    from tessera.launching import rank_server

    assert rank_server.PRELOAD == launch.PRELOAD
    # the whole command module too: `tessera train` starts the server after parsing, so torch imported by the
    # command's own module would run before the server's imports instead of beside them (3-4 s a run). For a run
    # that compiles, the server imports inductor's compiler too, and has found the CPU's vector instruction sets: a
    # rank forked from it holds both before compiling
    (tmp_path / "loaded.py").write_text(
        "import sys\n"
        "def loaded(name):\n"
        "    from torch._inductor.cpu_vec_isa import valid_vec_isa_list\n"
        "    return name in sys.modules, valid_vec_isa_list.cache_info().currsize\n"
    )
    code = (
        "import sys, multiprocessing.forkserver as fs, tessera.commands.main; "
        "from tessera.launching.rank_server import start_rank_server; "
        "start_rank_server(compiles=True); print('torch' in sys.modules, fs._forkserver._forkserver_pid is not None); "
        "import loaded; from tessera.launching.launch import run_ranks; "
        "print('torch._inductor.compile_fx' in sys.modules, run_ranks(loaded.loaded, 1, 'torch._inductor.compile_fx'))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    # the server runs; this process has not imported torch; nor inductor after importing the launcher; the rank has
    assert out.stdout.split() == ["False", "True", "False", "[(True,", "1)]"], out.stdout


@pytest.mark.parametrize(
    "argv", [["train", "--compile"], ["train"], ["bench", "--layouts", "one,tp2+compile", "--out", "unused"]]
)
def test_the_rank_server_preloads_inductor_for_the_runs_that_compile_only(argv):
    from tessera.commands.main import main

    class Started(Exception):
        pass

    with (
        mock.patch("tessera.commands.main.start_rank_server", side_effect=Started) as train,
        mock.patch("tessera.commands.bench.start_rank_server", side_effect=Started) as bench,
        pytest.raises(Started),
    ):
        main(argv)
    (start,) = [s for s in (train, bench) if s.called]
    assert start.call_args == mock.call(compiles="compile" in " ".join(argv))


@pytest.mark.parametrize("quick_exit", [True, False])
def test_the_rank_server_leaves_without_the_interpreters_shutdown(tmp_path, quick_exit):
    """Preloaded first, tessera.launching.rank_server ends the forkserver before any shutdown work once it has
    forked a rank: an atexit handler preloaded after it never runs (without it, it does). Imported anywhere else
    it does nothing."""
    from tessera.launching import launch

    assert launch.PRELOAD[0] == "tessera.launching.rank_server"
    (tmp_path / "leave_a_mark.py").write_text(
        "import atexit, os\natexit.register(lambda: open(os.environ['MARK'], 'w').write('shut down'))\n"
    )
    preload = ["tessera.launching.rank_server"] * quick_exit + ["leave_a_mark"]
    code = (
        "import atexit, os, multiprocessing as mp, multiprocessing.forkserver as fs; n = atexit._ncallbacks(); "
        "import tessera.launching.rank_server; assert atexit._ncallbacks() == n, 'a handler outside the forkserver'; "
        f"ctx = mp.get_context('forkserver'); ctx.set_forkserver_preload({preload!r}); fs.ensure_running(); "
        "p = ctx.Process(target=os.getpid); p.start(); p.join(); assert p.exitcode == 0"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MARK": str(tmp_path / "mark")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr  # capture_output waited for the forkserver: it holds the same pipes
    assert (tmp_path / "mark").exists() is not quick_exit


def test_a_process_another_forkserver_forked_keeps_its_collector_when_it_imports_the_rank_server(tmp_path):
    """Only the server that preloads tessera.launching.rank_server pauses its collector: a process forked by another
    forkserver (a user's worker, a server started without tessera's preload) that imports it first keeps the
    collector on and registers no exit handler (its stack holds forkserver.main too, under its own _serve_one)."""
    (tmp_path / "first_import.py").write_text(
        "import atexit, gc\n"
        "def run():\n"
        "    n = atexit._ncallbacks()\n"
        "    import tessera.launching.rank_server as rs\n"
        "    return gc.isenabled(), rs._server_pid, atexit._ncallbacks() - n\n"
    )
    code = (
        "import multiprocessing as mp, first_import; ctx = mp.get_context('forkserver'); "
        "ctx.set_forkserver_preload([]); pool = ctx.Pool(1); print(pool.apply(first_import.run)); pool.close()"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(True, -1, 0)"


def test_the_commands_imports_run_with_the_collector_paused_and_leave_it_as_it_was():
    from tessera.launching.rank_server import collector_paused

    for before in (True, False):
        (gc.enable if before else gc.disable)()
        try:
            with pytest.raises(ZeroDivisionError):
                with collector_paused():
                    assert not gc.isenabled()
                    1 / 0
            assert gc.isenabled() is before
        finally:
            gc.enable()


def test_the_command_and_the_models_import_no_dynamo_while_the_ranks_preload_it():
    """torch._dynamo costs 1.7 CPU seconds to import: a `tessera` command that only checks, plans or launches
    never needs it (its ranks, whose meta builds do, have it from the rank server's preload)."""
    from tessera.launching import launch

    assert "torch._dynamo" in launch.PRELOAD
    code = "import sys, tessera.cli, tessera.models, tessera.config; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
