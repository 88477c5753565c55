import gc
import os
import sys
from pathlib import Path

import pytest

# The repository's folders import as tessera.* (the install maps them). `python -m pytest` from the repository root
# puts the root first on sys.path, where the bare `kernels/` folder shadows PyPI's `kernels` (Hugging Face's, which
# transformers imports since 5.25: every test comparing with transformers failed on its ImportError). The root
# leaves sys.path before any test module is imported; the ranks this suite starts inherit the path without it.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.compile's CPU kernels in scalar C++: what the tests check of compile (tessera's blocks traced with their
# collectives and DTensors, AOT autograd, FSDP2 and the pipeline around the compiled blocks, the numerics against
# eager) is the same, and a GPU compiles Triton, never this C++; gcc compiles the scalar kernels faster and no
# interpreter probes the CPU's vector instruction sets. The five compiled contract rows, cold cache: 175.7 -> 140.2
# busy core-s. TORCHINDUCTOR_VEC_ISA_OK=1 runs them vectorized, as a CPU user's `tessera train --compile` does
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# Without a GPU the Triton kernels run on CPU tensors through the interpreter. Triton reads this when a
# kernel is decorated, so it is set before any test imports tessera.kernels.triton_* (torch does not import triton).
import torch  # noqa: E402


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --cpu-report PATH (with -n 0): each test's machine-wide CPU seconds, where the CPU-bound suite's time goes
from cpu_report import pytest_addoption, pytest_configure  # noqa: E402, F401

from tessera.launching.rank_server import COMPILE_PRELOAD  # noqa: E402


# modules whose tests start ranks or the CLI (seconds each): the slow tier; `-m 'not slow'` is the fast one
SLOW_MODULES = {
    "test_contract",
    "test_fp8_contract",
    "test_contract_bf16",
    "test_contract_qwen3",
    "test_custom_model",
    "test_qwen3_checkpoint",
    "test_fsdp_views",
    "test_four_d",
    "test_reliability",
    "test_cli_train",
    "test_readme",
    "test_hf",
    "test_checkpoint",
    "test_pipeline",
    "test_context",
    "test_comm_stats",
    "test_planner_memory",
    "test_profile",
    "test_bench",
    "test_bench_moe",
    "test_gpu_suite",
    "test_bench_qkv_projection",  # the projection benchmark's CPU plumbing (3 s)
    "test_fuzz_config",
    "test_activation_checkpointing",
    "test_run_edges",
    "test_contract_moe",
    "test_contract_families",
    "test_moe_checkpoint",
    "test_moe_cli",
    "test_expert_parallel",
    "test_checkpoint_async",
    "test_drift",
    "test_packed_documents",
    "test_packed_cli",
    "test_launcher_death",
    "test_muon_contract",
    "test_loggers",
    "test_context_variants",
    "test_convert_families",  # convert -> train --init-from on one process and pp2
    "test_offload",  # every layout with --offload optimizer and params against itself without
    "test_fault_tolerance",  # replica groups under torchft, faults planted: seconds each
}

# and single tests elsewhere that run the CLI or train on several ranks for more than a few seconds
SLOW_TESTS = {
    # fast-tier tests that start ranks or fresh interpreters, 4-7 s each (the fast tier measured 117.6 s here and
    # 124.6 s in CI on torch 2.11 with them)
    "test_the_command_and_the_models_import_no_dynamo_while_the_ranks_preload_it",
    "test_trainers_sharing_one_world_mesh_train_bitwise_like_a_trainer_on_its_own",
    "test_build_mesh_on_gloo_ranks_matches_layout",
    # and the two slowest in-process ones: opcheck of the attention ops (the interpreted kernel run ~30 times,
    # 7-10 s) and the planner over 64 GPUs for an MoE model (8,414 layouts ranked, 6-8 s)
    "test_attention_custom_ops_have_fake_and_autograd",
    "test_the_planner_offers_expert_parallel_for_an_moe_model",
    "test_the_command_exits_without_the_teardown_yet_joins_threads_runs_atexit_and_flushes",
    "test_resume_dp2_to_dp4_to_one_process_equals_the_uninterrupted_run",
    "test_a_data_set_larger_than_the_run_is_read_only_as_far_as_needed",
    "test_a_packed_sft_batch_equals_each_example_alone_on_dp2xtp2_and_cp2",
    "test_sft_training_records_the_targets_kept_and_masked",
    "test_held_out_hf_data_gives_the_same_eval_loss_on_dp2_as_on_one_process",
    "test_the_benchmark_runs_on_a_tiny_setting",
    "test_token_files_train_equally_on_dp2xtp2_and_one_process_and_resume_on_another_layout",
    "test_eval_every_reports_the_held_out_loss_equally_on_every_layout",
    "test_plan_calibrate_on_this_cpu_writes_the_file_the_planner_then_reads",
    "test_the_readme_calibration_commands_run_as_written",
    "test_bench_planner_check_smoke",
    "test_baseline_imports_no_tessera_parallel_layer_and_runs_from_its_command_line",
    "test_pp_alone_trains_and_says_what_it_chose",
    "test_a_v_schedule_needs_only_its_name",
    # a CLI or multi-rank run of several seconds each (the fast tier's slowest, moved here to keep it in 2 minutes)
    "test_profiling_a_step_on_two_ranks_changes_no_loss",
    "test_the_readme_command_profiles_its_step_and_prints_one_line",
    "test_bf16_runs_in_bf16_on_one_process_and_says_so_from_what_ran",
    "test_the_readme_quotes_the_start_up_lines_matmul_shares",
    "test_plan_cli_ranks_layouts_and_dry_runs_the_best",
    "test_the_cli_exits_2_with_one_line_and_runs_nothing",
    "test_the_block_runs_as_written",
    "test_tessera_plan_prints_the_best_expert_parallel_layout_and_its_flags",
    "test_bench_muon_writes_its_json",
    "test_the_convergence_benchmark_records_the_dtypes_it_measured_and_refuses_a_missing_gpu",
    # the CLI's own runs in a fresh interpreter, 3-10 s each (plan, memory, python -m tessera.cli)
    "test_plan_counts_muons_state_when_asked_and_trains_with_it",
    # a training run through the CLI (SFT's start-up line) and a fresh interpreter's FP8 run
    "test_the_start_up_line_names_the_data_and_the_template",
    "test_an_fp8_run_prints_nothing_of_torchaos_enum_registration",
    "test_cli_prints_the_reference_table",
    "test_the_memory_command_honours_every_axis_it_is_given",
    "test_a_muon_recipe_says_what_its_table_leaves_out_and_the_planners_line_counts_it",
    "test_the_memory_command_agrees_with_the_planner",
    "test_plan_scores_a_named_layout_beside_the_ranking",
    "test_plan_cli_json",
    "test_plan_without_gpus_asks_for_them_in_one_line",
    "test_tessera_train_starts_the_rank_server_with_the_launchers_imports_and_no_torch_of_its_own",
    "test_python_m_tessera_cli_is_the_command",
    # multi-rank runs of a few seconds: the harness's deadlines waited out, users' models trained on layouts
    "test_a_hung_rank_fails_within_the_timeout_naming_rank_and_collective",
    "test_a_stalled_model_collective_names_rank_axis_and_operation",
    "test_a_user_model_trains_equivalently_on_tp2_dp2_and_dp2xtp2",
    "test_a_checkpoint_moves_between_layouts_bitwise_and_a_dropped_shard_is_named",
    "test_every_ranked_layout_is_runnable_and_fits",
    "test_greedy_tokens_equal_transformers_on_tp2_ranks_for_every_family",  # tessera generate on tp2 ranks
    "test_a_trained_checkpoint_generates_the_same_text_on_one_process_and_tp2_ranks",  # train, then the CLI
    "test_tp2_and_ep2_train_like_one_process",  # gpt-oss, DeepSeek-V3 on 2 ranks against one process, 5-17 s each
    "test_a_pipeline_stage_of_dense_layers_alone_trains",  # DeepSeek-V3's tessera train on pp3, ~15 s
    # the attention variants' Triton kernels through the interpreter (10-30 s each)
    "test_triton_kernels_match_the_definition",
    "test_triton_custom_ops_with_window_offset_and_a_value_head_dim_of_its_own",
    # and the original kernel's hypothesis tests through the interpreter (16.5 s and 7.7 s in the fast tier once
    # the kernel took a window, an offset and v's own head dim: more variants to interpret)
    "test_triton_attention_matches_the_definition",
    "test_triton_document_attention_matches_the_float64_definition",
    # the chunked loss's kernels through the interpreter on tp ranks, and their benchmark's CPU plumbing
    "test_tp_ranks_through_the_kernels_equal_one_process",
    "test_the_loss_kernels_benchmark_runs_and_records_both_paths",
    "test_the_per_step_scale_precompute_gives_the_all_gathers_own_scales_and_changes_no_step",  # dp2 FP8, twice
    "test_a_run_without_fp8_never_imports_torchao",  # a fresh interpreter trains a step
}


# The longest modules first (seconds of pytest, one process, measured 2026-11-26): `-n 2 --dist loadfile`
# (pyproject.toml's addopts) hands whole files to its two workers in this order, so the last file a worker
# takes is a short one and neither waits long for the other at the end (longest processing time first)
LONGEST_FIRST = [
    "test_contract",
    "test_contract_families",
    "test_contract_qwen3",
    "test_reliability",
    "test_fp8_contract",
    "test_four_d",
    "test_contract_moe",
    "test_contract_bf16",
    "test_pipeline",
    "test_launcher_death",
    "test_gpu_suite",
    "test_muon_contract",
    "test_readme",
    "test_docs",
    "test_planner",
    "test_moe_accounting",
    "test_planner_memory",
    "test_bench",
    "test_comm_stats",
    "test_cli_train",
    "test_loggers",
    "test_hf_data",
    "test_context",
    "test_custom_model",
    "test_bench_moe",
    "test_attention_variants",
    "test_hf",
    # then the fast tier's longest (seconds of `-m 'not slow'`, 2026-11-27): test_schedule (12.5 s) taken last
    # left one worker 14 s behind the other
    "test_kernels",
    "test_schedule",
    "test_harness",
    "test_cli_fuzz",
    "test_muon",
    "test_generate",
    "test_fused_loss",
    "test_cross_entropy_kernels",
]


# Modules whose tests keep both cores busy on their own (their ranks: machine CPU seconds over wall seconds at
# least 1.4, measured test by test with `-n 0` on the 2-core machine, 2026-11-27; CPU seconds in 2 cores). They
# run one after the other on one worker (pytest_xdist_make_scheduler below), while the other takes the rest, mostly
# one-process tests and runs that wait (kills, timeouts, restarts). Two rank-spawning files side by side gained
# little: two copies of test_contract_bf16 took 94 s together against 50 s alone, and 14% more CPU
RANK_HEAVY = {
    "test_contract_families",  # 130 CPU-s in 72 s
    "test_contract",  # 109 CPU-s in 63 s
    "test_contract_qwen3",  # 94 CPU-s in 53 s
    "test_four_d",  # 82 CPU-s in 42 s
    "test_fp8_contract",  # 79 CPU-s in 46 s
    "test_contract_bf16",  # 56 CPU-s in 32 s
    "test_muon_contract",  # 46 CPU-s in 27 s
    "test_contract_moe",  # 45 CPU-s in 26 s
    "test_readme",  # 37 CPU-s in 24 s
    "test_planner_memory",  # 35 CPU-s in 21 s
    "test_cli_train",  # 32 CPU-s in 20 s
    "test_plan_api",  # 26 CPU-s in 17 s
    "test_comm_stats",  # 26 CPU-s in 13 s
    "test_fuzz_config",  # 18 CPU-s in 10 s
    "test_checkpoint",  # 17 CPU-s in 11 s
    "test_mesh",  # 15 CPU-s in 8 s
    "test_packed_documents",  # 13 CPU-s in 8 s
    "test_deepseek_v3",  # 12 CPU-s in 9 s
    "test_moe_checkpoint",  # 11 CPU-s in 8 s
    "test_tokens",  # 10 CPU-s in 7 s
    "test_build",  # 9 CPU-s in 5 s
    "test_clip",  # 8 CPU-s in 5 s
    "test_drift",  # 7 CPU-s in 5 s
    "test_moe_cli",  # 6 CPU-s in 4 s
    "test_gpt_oss",  # 6 CPU-s in 4 s
}


# what the ranks of the tests import beside tessera's own list (tessera.launching.launch.PRELOAD): the tests'
# rank functions and torchao's FP8 (a missing module is skipped), once in each worker's forkserver instead of
# once in each rank (test_contract's 21 pipeline rows on 4 ranks: 61.6 -> 55.6 CPU seconds); and inductor's
# compiler, as `tessera train --compile`'s server has (rank_server.COMPILE_PRELOAD): a compiled row's ranks no
# longer import it (pp2-interleaved+compile, cold cache: 37.7 -> 34.1 machine CPU-s, 3 runs each). It once made
# every eager rank slower (test_contract's 21 pipeline rows 54.8 -> 66.8), by the collections that walked its
# objects in every rank; frozen in the server since (tessera.launching.rank_server), test_contract's 40 rows on 4
# ranks measured 64.0 without it and 62.2 with (5 runs each, 54-72 CPU-s: no difference)
TEST_PRELOAD = ["helpers", "shared_spawns", "torchao.float8", *COMPILE_PRELOAD]


def pytest_sessionstart(session):
    """Start this test process's forkserver with the test imports (not in an xdist controller, which runs no
    test). tessera.launching.launch finds it running and forks the ranks from it."""
    autotune_choice()  # a misspelt setting stops the run before any test
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    import multiprocessing
    from multiprocessing import forkserver

    from tessera.launching import launch

    # the benchmark scripts the tests run in this process (helpers.script_here) define rank functions that the
    # ranks import by module name: from benchmarks/, on the path the forkserver hands its ranks (this one's now)
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.append(benchmarks)
    multiprocessing.get_context("forkserver").set_forkserver_preload(launch.PRELOAD + TEST_PRELOAD)
    forkserver.ensure_running()


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject.toml's addopts), with the RANK_HEAVY modules as one unit of work: one worker
    runs them one after the other while the other takes the remaining files, longest first. A run of
    RANK_HEAVY modules only (CI's torch 2.11 contract files) keeps one file a unit. (xdist's own
    `--dist loadgroup` marks cannot do it on pytest 9.2: xdist 3.8 renames an item's `_nodeid`, which pytest
    9.2 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None  # another --dist asked for on the command line: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class RankHeavyTogether(LoadScopeScheduling):
        together: bool | None = None

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if self.together is None:
                self.together = rank_heavy_together([n.split("::", 1)[0] for n in self.collection or []])
            return "rank-heavy modules" if self.together and _module_name(path) in RANK_HEAVY else path

    return RankHeavyTogether(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, for each worker: the --dist it schedules by, which a worker cannot read from its own
    options (xdist sets them to "no" there); `spawn_pool` asks it."""
    node.workerinput["tessera_dist"] = node.config.getvalue("dist")


def _module_name(path: str) -> str:
    return path.rpartition("/")[2].removesuffix(".py")


def rank_heavy_together(paths: list[str]) -> bool:
    """Whether one worker takes every RANK_HEAVY module of a run of these files (pytest_xdist_make_scheduler):
    only where other files can share the cores, not for a run of RANK_HEAVY files alone (CI's torch 2.11
    contract files), which keeps one file a unit."""
    return not all(_module_name(p) in RANK_HEAVY for p in paths)


def pooled_modules(config, items) -> set[str]:
    """The test modules whose shared-spawn rows train together (tests/shared_spawns.py): those this process runs
    all of. Every module without xdist; with it, the RANK_HEAVY modules when the controller sends them to one
    worker together (`--dist loadfile`, pyproject.toml's default, on a run with other files too); else none."""
    names = {item.module.__name__ for item in items if getattr(item, "module", None)}
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return names
    files = [item.nodeid.split("::", 1)[0] for item in items]
    if workerinput.get("tessera_dist") == "loadfile" and rank_heavy_together(files):
        return {n for n in names if n.rpartition(".")[2] in RANK_HEAVY}
    return set()


@pytest.fixture(scope="session")
def spawn_pool(request):
    """The test files' shared spawns (tests/shared_spawns.py), pooled across `pooled_modules`."""
    from shared_spawns import SpawnPool  # lazy: it imports tessera.parallel, which xdist's controller never needs

    return SpawnPool(request.session, pooled_modules(request.config, request.session.items))


@pytest.fixture(scope="module")
def runs(spawn_pool, request):
    """The requesting file's shared-spawn rows (its module-level `spawned_rows`), trained with other files' of the
    same world size where they run here; `runs.result(key)` is a row's result. A file may define its own `runs`."""
    return spawn_pool.spawns_of(request.module)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: each file's own order is kept
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Freeze what the imports and the collection made (torch's, hypothesis's, every test module's: ~350,000
    objects) out of the garbage collector's reach: a full collection then walks only what the tests made since.
    A test process's full collections were up to 18% of its CPU (test_planner: 4.1 of 22.7 CPU-s; 1.4 frozen)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Back in the collector's reach for the interpreter's last collection at exit: frozen, triton's IR objects
    that sit in reference cycles outlived it, and nanobind printed "leaked 4 instances!" at every exit."""
    gc.unfreeze()


AUTOTUNE_CHOICES = ("first", "all")


def autotune_choice() -> str:
    choice = os.environ.get("TESSERA_TEST_AUTOTUNE", "first")
    if choice not in AUTOTUNE_CHOICES:
        raise pytest.UsageError(f"TESSERA_TEST_AUTOTUNE={choice!r}: use one of {', '.join(AUTOTUNE_CHOICES)}")
    return choice


@pytest.fixture(autouse=True)
def attention_autotune(request, monkeypatch):
    """GPU tests hold the attention kernels' numerics, not their speed: by default each autotuned kernel keeps
    its first config, so a shape compiles one kernel instead of five and none is benchmarked.
    TESSERA_TEST_AUTOTUNE=all tunes over every config, as a user's run does."""
    if "gpu" not in request.keywords or autotune_choice() == "all":
        return
    from tessera.kernels import triton_attention_kernels as kernels  # lazy: CPU-only runs never need it here

    for tuner in (kernels._attention_fwd_kernel, kernels._attention_bwd_dkdv_kernel, kernels._attention_bwd_dq_kernel):
        monkeypatch.setattr(tuner, "configs", tuner.configs[:1])


@pytest.fixture(scope="session")
def reference():
    """The one-process run every layout is compared with: (losses, grad norms, gradients of step 1)."""
    from helpers import small_config, train_losses_and_grads
    from tessera.launching.launch import run_ranks

    return run_ranks(train_losses_and_grads, 1, small_config(), timeout=120)[0]


@pytest.fixture(scope="session")
def masked_reference():
    """The one-process run on targets masked unevenly across rows."""
    from helpers import small_config, train_losses_and_grads
    from tessera.launching.launch import run_ranks

    return run_ranks(train_losses_and_grads, 1, small_config(), True, timeout=120)[0]


PIPELINE_BASE = dict(n_layers=8, global_batch=8)  # deep enough for 8 virtual stages, rows for dp4 x 2 microbatches


@pytest.fixture(scope="session")
def deep_reference():
    """The one-process run the pipeline layouts are compared with (8 layers, 8 rows per step)."""
    from helpers import small_config, train_losses_and_grads
    from tessera.launching.launch import run_ranks

    return run_ranks(train_losses_and_grads, 1, small_config(**PIPELINE_BASE), timeout=120)[0]


@pytest.fixture
def refused(monkeypatch, capsys):
    """`refused(*ARGS)`: the one error line of `tessera train ARGS`, which must fail before any rank starts
    (tessera.training.run.train, where ranks would start, raises if reached)."""
    import tessera.training.run

    def never(*args, **kwargs):
        raise AssertionError("the command went past its checks")

    monkeypatch.setattr(tessera.training.run, "train", never)

    def run(*argv):
        from tessera.cli import main

        try:
            code = main(["train", "--quiet", *argv])
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1, (code, out, err)
        return lines[0]

    return run
