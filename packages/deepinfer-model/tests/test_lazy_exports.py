"""The package's names are imported on first use: the sampling rules without torch, the model code without
Dynamo (`torch.compiler.disable` is applied when a compile needs it). Each import check runs in a fresh
interpreter, since this one has loaded everything already."""

import importlib
import subprocess
import sys

import deepinfer_model
import deepinfer_model.sampling
import pytest


def _run(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_sampling_rules_import_no_torch():
    _run(
        "import sys\n"
        "import deepinfer_model.sampling.params\n"
        "from deepinfer_model import MAX_TEMPERATURE, validate_sampling_fields\n"
        "from deepinfer_model.sampling import RowParams, validate_token_ids\n"
        "validate_sampling_fields(MAX_TEMPERATURE, 0.5, 4, 0.0, None)\n"
        "validate_token_ids('allowed_token_ids', [1, 2])\n"
        "RowParams(temperature=0.5)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )


def test_the_model_code_imports_no_dynamo():
    _run(
        "import sys\n"
        "import deepinfer_model\n"
        "for name in deepinfer_model.__all__:\n"
        "    getattr(deepinfer_model, name)\n"
        "import deepinfer_model.quant, deepinfer_model.numerics, deepinfer_model.layers.indexer\n"
        "assert 'torch' in sys.modules\n"
        "assert 'torch._dynamo' not in sys.modules\n"
    )


@pytest.mark.parametrize("package", [deepinfer_model, deepinfer_model.sampling])
def test_every_public_name_is_its_modules_object(package):
    table = package._MODULES
    assert sorted(package.__all__) == sorted(name for names in table.values() for name in names)
    for module, names in table.items():
        loaded = importlib.import_module(module, package.__name__)
        for name in names:
            assert getattr(package, name) is getattr(loaded, name), name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        package.not_a_name  # noqa: B018


def test_a_function_marked_before_dynamo_loads_runs_outside_the_compiled_region():
    """Marked while Dynamo is not loaded, a function is disabled by `prepare_for_compile` and then breaks a
    compiled region's graph exactly as one marked with Dynamo loaded (the reference); never prepared, it
    still runs eagerly, at the cost of more graph breaks in the first trace."""
    out = _run(
        "import sys, torch\n"
        "from deepinfer_model.compile_boundary import outside_compiled_graph, prepare_for_compile\n"
        "seen = []\n"
        "def host(x):\n"
        "    seen.append(torch.compiler.is_compiling())\n"
        "    return x + 1\n"
        "late, prepared = outside_compiled_graph(host), outside_compiled_graph(host)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "x = torch.arange(4.0)\n"
        "def breaks(fn):\n"
        "    torch._dynamo.reset()\n"
        "    torch._dynamo.utils.counters.clear()\n"
        "    got = torch.compile(lambda t: fn(t * 2) * 3, backend='eager')(x)\n"
        "    assert torch.equal(got, (x * 2 + 1) * 3)\n"
        "    return sum(torch._dynamo.utils.counters['graph_break'].values())\n"
        "late_breaks = breaks(late)\n"
        "prepare_for_compile()\n"
        "prepared_breaks = breaks(prepared)\n"
        "reference_breaks = breaks(outside_compiled_graph(host))\n"
        "print(late_breaks > reference_breaks, prepared_breaks == reference_breaks > 0, seen)\n"
    )
    assert out.split("\n")[0] == "True True [False, False, False]"
