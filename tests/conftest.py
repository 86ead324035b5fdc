import inspect
import os
import re
import sys

import pytest
import torch

# One compute thread: several ranks share two cores, and results must not depend on thread count.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py as `distributed`


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the measured-peak cache out of the user's home."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def two_nodes():
    """(namespace, address, veth device) of two nodes joined by a veth pair (tests/netns.py), for the
    multi-node and Slurm tests; mark them with netns.needs_netns."""
    import netns
    with netns.two_nodes("s", "10.231.7") as nodes:
        yield nodes


# The two tiers. `make test` runs every test; `make test-fast` (at most 3 minutes here) runs the
# rules, the units and the single-process tests: a test whose own source starts ranks or other
# processes is marked `ranks` and left out, as is every test of a module in LONG_MODULES (one
# process, but minutes in all) and each test in LONG_TESTS. A test is judged by its source, so
# a new one that starts ranks lands in the full tier without a word here.
STARTS_PROCESSES = ("run_on_ranks(", "launch_local(", "torchrun", "two_nodes", "subprocess.", "\"--nproc\"",
                    "'--nproc'", "spawn(", "nproc=")
LONG_MODULES = {"test_pipeline_matrix", "test_checkpoint_mutations", "test_numeric_extremes", "test_families",
                "test_train", "test_moe_hf", "test_validation", "test_data_safety", "test_run_dir",
                "test_pipeline_schedules"}

# single-process tests of more than about 10 s here
LONG_TESTS = {"test_the_planners_own_layout_is_no_worse_than_the_published_one",
              "test_quick_mode_runs_every_part_and_the_device_equals_the_cpu",
              "test_compiled_blocks_train_as_eager_with_the_router_left_eager", "test_bench_generate_against_transformers",
              "test_days_picks_the_first_node_count_that_finishes_in_time_and_says_so",
              "test_every_layout_runs_the_single_process_losses"}


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: starts ranks or other processes, or is part of a long module "
                                       "(left out of `make test-fast`)")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _called_sources(source: str, namespace: dict, seen: set) -> list[str]:
    """The sources of the module's functions (and callable objects' classes) that `source` calls."""
    found = []
    for name in set(re.findall(r"\b(\w+)\(", source)) - seen:
        seen.add(name)
        called = namespace.get(name)
        if callable(called) and hasattr(called, "__wrapped__"):  # functools.cache and lru_cache wrappers
            called = inspect.unwrap(called)
        if inspect.isfunction(called):
            found.append(_source(called))
        elif callable(called) and not inspect.isclass(called) and not inspect.isbuiltin(called):
            found.append(_source(type(called)))  # a callable object (tests/distributed.SharedLaunches)
    return found


def _starts_processes(item) -> bool:
    """Whether the test's source, what it calls (two calls deep, among its module's names and
    what the module imported), or a fixture it uses, names a way to start processes."""
    namespace, seen = vars(item.module), {item.function.__name__}
    sources = [_source(item.function)]
    for depth in range(2):
        sources += [called for source in list(sources) for called in _called_sources(source, namespace, seen)]
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            sources.append(_source(definition.func))
    return any(word in source for source in sources for word in STARTS_PROCESSES)


def pytest_collection_modifyitems(config, items):
    judged: dict[object, bool] = {}
    for item in items:
        module = os.path.splitext(os.path.basename(str(item.fspath)))[0]
        key = (module, getattr(item, "originalname", item.name))
        if key not in judged:
            judged[key] = module in LONG_MODULES or key[1] in LONG_TESTS or _starts_processes(item)
        if judged[key]:
            item.add_marker(pytest.mark.ranks)
