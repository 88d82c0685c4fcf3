"""Host lists: SLURM's compressed node lists (against hand-written expansions and, where SLURM is
installed, against ``scontrol show hostnames`` itself), hostfiles, --hosts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.hosts import LaunchError, expand_nodelist, parse_hosts, read_hostfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmUnavailable, ensure_installed  # noqa: E402

CASES = {
    "node01": ["node01"],
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "n[9-11]": ["n9", "n10", "n11"],
    "n[098-101]": ["n098", "n099", "n100", "n101"],
    "x,n[1-2],y": ["x", "n1", "n2", "y"],
    "a[1-2]b[3-4]": ["a1b3", "a1b4", "a2b3", "a2b4"],
    "rack1-n[1-2]": ["rack1-n1", "rack1-n2"],
    "n[3,1-2]": ["n3", "n1", "n2"],  # order as written
    "n[1-2],n[1-2]": ["n1", "n2", "n1", "n2"],  # duplicates kept
    "gpu[07-08,10],gpu12": ["gpu07", "gpu08", "gpu10", "gpu12"],
}


@pytest.mark.parametrize("text, hosts", CASES.items())
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


def test_matches_scontrol_show_hostnames(tmp_path):
    """Against SLURM's own expansion; installs SLURM itself when it can (as test_slurm.py)."""
    try:
        ensure_installed()
    except SlurmUnavailable as e:
        pytest.skip(f"SLURM unavailable: {e}")
    scontrol = shutil.which("scontrol")
    conf = tmp_path / "slurm.conf"  # scontrol needs a config source, not a running controller
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    for text, hosts in CASES.items():
        r = subprocess.run([scontrol, "show", "hostnames", text], env={"SLURM_CONF": str(conf)},
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == hosts == expand_nodelist(text), text


@pytest.mark.parametrize("text, why", [
    ("n[1-2", "unbalanced '['"),
    ("n1-2]", "unbalanced ']'"),
    ("n[a-b]", "'a-b' is not N or N-M"),
    ("n[5-3]", "range '5-3' runs backwards"),
    (",", "no hosts in it"),
])
def test_bad_nodelists(text, why):
    with pytest.raises(LaunchError) as e:
        expand_nodelist(text)
    assert str(e.value) == f"bad SLURM node list {text!r}: {why}"


def test_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\n  alpha slots=8\n\nbeta # second\ngamma\n")
    assert read_hostfile(f) == ["alpha", "beta", "gamma"]
    f.write_text("# nothing\n\n")
    with pytest.raises(LaunchError, match="lists no hosts"):
        read_hostfile(f)


def test_parse_hosts():
    assert parse_hosts("a, b,c") == ["a", "b", "c"]
    assert parse_hosts("gpu[1-3]") == ["gpu1", "gpu2", "gpu3"]
    with pytest.raises(LaunchError, match="--hosts is empty"):
        parse_hosts(" , ")
