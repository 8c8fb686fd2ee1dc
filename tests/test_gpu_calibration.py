"""Fitting a GPU profile to the CUDA harness's contention curves (libra_jax.gpu_calibration)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libra_jax import gpu_calibration as gc
from libra_jax import model

ROOT = Path(__file__).resolve().parents[1]
SMS, HBM = 132, 4800.0  # the h200 profile's SMs and GB/s


def synthetic_rows(per_block: float, efficiency: float, units: float, memory: float,
                   blocks=(1, 2, 4, 8, 16, 32, 64), nbytes=64 << 20) -> list[gc.ContendRow]:
    """Rows a GPU obeying the model's formulas with these parameters would give."""
    rows = []
    for k in blocks:
        alone_us = nbytes / (k * per_block * 1e3)            # linear in blocks
        overlapped = k * per_block * efficiency              # GB/s beside compute
        gemm = SMS / (SMS - k * units)
        triad = HBM / (HBM - memory * overlapped)
        rows.append(gc.ContendRow("gemm", 8, nbytes, k, 2000.0, gemm, alone_us, 1 / efficiency))
        rows.append(gc.ContendRow("triad", 8, nbytes, k, 300.0, triad, alone_us,
                                  1 / efficiency))
    return rows


def test_fit_recovers_known_parameters():
    fit = gc.fit_contention(synthetic_rows(20.0, 0.7, 1.5, 9.0), compute_units=SMS,
                            memory_gbyte_per_s=HBM)
    assert fit.per_block_gbyte_per_s == pytest.approx(20.0)
    assert fit.overlap_block_efficiency == pytest.approx(0.7)
    assert fit.units_per_block == pytest.approx(1.5)
    assert fit.memory_bytes_per_bus_byte == pytest.approx(9.0)
    assert fit.blocks == (1, 2, 4, 8, 16, 32, 64)


def test_fit_needs_both_workloads():
    rows = [r for r in synthetic_rows(20.0, 0.7, 1.0, 3.0) if r.workload == "gemm"]
    with pytest.raises(ValueError, match="lack the triad workload"):
        gc.fit_contention(rows, compute_units=SMS, memory_gbyte_per_s=HBM)


def write_csv(path: Path, rows: list[gc.ContendRow]) -> None:
    lines = ["device,NVIDIA H200,sm_90,132 SMs,1056 co-resident blocks",
             "contend_header,workload,ranks,bytes,blocks,compute_alone_us,compute_slowdown,"
             "allreduce_alone_us,allreduce_slowdown"]
    lines += [f"contend,{r.workload},{r.ranks},{r.bytes},{r.blocks},{r.compute_alone_us},"
              f"{r.compute_slowdown},{r.allreduce_alone_us},{r.allreduce_slowdown}" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def test_read_csv_and_malformed_lines(tmp_path):
    rows = synthetic_rows(20.0, 0.7, 1.0, 3.0)
    write_csv(tmp_path / "c.csv", rows)
    assert gc.read_contend_csv(tmp_path / "c.csv") == rows
    (tmp_path / "bad.csv").write_text("contend,gemm,8,64,1,x,1,1,1\n")
    with pytest.raises(ValueError, match=r"bad.csv:1: not a contend line"):
        gc.read_contend_csv(tmp_path / "bad.csv")
    (tmp_path / "none.csv").write_text("bench,2,oneshot\n")
    with pytest.raises(ValueError, match="no contend lines"):
        gc.read_contend_csv(tmp_path / "none.csv")


def test_script_writes_a_separate_labelled_profile_marked_measured(tmp_path):
    write_csv(tmp_path / "c.csv", synthetic_rows(22.0, 0.8, 1.25, 4.0))
    shipped = (ROOT / "libra_jax/profiles/h200.json").read_bytes()
    out = tmp_path / "h200-virtual-ranks.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_profile.py"), str(tmp_path / "c.csv"),
                    "--out", str(out), "--gpu", "NVIDIA H200"],
                   check=True, capture_output=True, text=True)
    # The proxy curves make their own profile, named and noted as such; h200.json stays.
    assert (ROOT / "libra_jax/profiles/h200.json").read_bytes() == shipped
    data = json.loads(out.read_text())
    assert data["name"] == "h200-virtual-ranks"
    assert any("proxy curves" in note and "virtual ranks" in note for note in data["notes"])
    section = data["nccl_style"]
    assert section["units_per_block"] == {"value": 1.25, "source": "measured",
                                          "ref": section["units_per_block"]["ref"]}
    assert "NVIDIA H200" in section["units_per_block"]["ref"]
    assert section["softmin_p"]["source"] == "assumption"  # not measurable on one GPU
    profile = model.profile_from_dict(data)
    assert profile.nccl_style.per_block_bytes_per_s == pytest.approx(22e9)
    assert profile.nccl_style.memory_bytes_per_bus_byte == pytest.approx(4.0)


def test_only_nccl_style_profiles_are_updated():
    fit = gc.ContentionFit(1.0, 1.0, 1.0, 1.0, (1,))
    with pytest.raises(ValueError, match="not of the nccl-style form"):
        gc.apply_fit({"name": "cpu-host", "form": "libra-fit"}, fit, ref="x")
