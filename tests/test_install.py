"""``pip install .`` puts one package of this project into site-packages, ``nla_grpo``: another project's ``shared``
or ``evals`` beside it shadows nothing of ours, and ours shadows nothing of theirs."""
import subprocess
import sys
import zipfile

from conftest import ROOT


def _source_copy(dest):
    """The checkout's files as git sees them, so the build's ``build/`` and ``*.egg-info`` land outside the checkout."""
    import shutil

    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_the_wheel_holds_one_package_and_runs_beside_another_evals(tmp_path):
    wheels = tmp_path / "wheels"
    source = _source_copy(tmp_path / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(source)], check=True, capture_output=True, text=True, timeout=300)
    wheel = next(wheels.glob("nla_grpo-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"nla_grpo"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "nla_grpo/rollout/vllm/plugin.py" in names and "nla_grpo/shared/config.py" in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "nla-grpo = nla_grpo.orchestrator.cli:main" in entry and "= nla_grpo.rollout.vllm.plugin:register" in entry

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    other = tmp_path / "other" / "evals"  # a widely used package has this name; first on the path here
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("THEIRS = True\n")
    probe = ("import evals, sys\n"
             "from nla_grpo.orchestrator.cli import main\n"
             "rc = main(['config', 'check', sys.argv[1]])\n"
             "import nla_grpo.evals.tasks as ours\n"
             "assert evals.THEIRS and ours.__file__.startswith(sys.argv[2]), (evals.__file__, ours.__file__)\n"
             "sys.exit(rc)\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path / 'other'}:{site}", "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", probe, str(ROOT / "deploy" / "tiny.yaml"), str(site)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout[-2000:] + res.stderr[-2000:]
