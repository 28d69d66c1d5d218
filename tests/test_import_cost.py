"""The ledger and the CLI never import torch: they touch no tensor, and torch costs seconds."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["dataflow", "dataflow.cli", "dataflow.streams"])
def test_importing_the_core_leaves_torch_and_numpy_out(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "print(','.join(m for m in ('torch', 'numpy', 'stores', 'training', 'eval') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"import {module} pulled in {out}"


def test_a_ref_decoded_without_torch_imports_it_when_its_dtype_is_needed() -> None:
    code = (
        "import sys\n"
        "from dataflow import SampleRef\n"
        'ref = SampleRef.from_json(\'{"sample_id": "s", "store": "local://", '
        '"generation": 0, "metadata": {}, '
        '"specs": {"x": {"shape": [2, 3], "dtype": "bfloat16"}}}\')\n'
        "print(ref.specs['x'].nbytes, ref.specs['x'].dtype, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["12", "torch.bfloat16", "True"]


def test_importing_stores_leaves_torch_out_until_a_store_class_is_used() -> None:
    code = (
        "import sys, stores\n"
        "before = 'torch' in sys.modules\n"
        "stores.known_schemes()\n"
        "after_schemes = 'torch' in sys.modules\n"
        "from stores import SharedDirFeatureStore\n"
        "print(before, after_schemes, 'torch' in sys.modules, SharedDirFeatureStore.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False", "True", "SharedDirFeatureStore"]


def test_importing_the_testing_harness_leaves_torch_out_until_a_strategy_is_used() -> None:
    # The cluster's and PostgresServer's users (a ledger actor inside a simulated host, a
    # chaos trial's PostgreSQL) import dataflow.testing; torch would cost each a second.
    code = (
        "import sys, dataflow.testing\n"
        "from dataflow.testing import Cluster, PostgresServer, cluster_unavailable\n"
        "before = ','.join(m for m in ('torch', 'hypothesis') if m in sys.modules) or '-'\n"
        "from dataflow.testing import tensors\n"
        "print(before, 'torch' in sys.modules, tensors.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["-", "True", "tensors"]
