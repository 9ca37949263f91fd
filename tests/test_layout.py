"""docs/development.md's "piece | where" table names the project's real layout: every place it names exists,
and every package and top-level module of the installed project appears in it."""
import re

from conftest import ROOT


def _table_places() -> list[str]:
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    table = text[text.index("| piece | where |"):]
    table = table[: table.index("\n\n")]
    return [p for row in table.splitlines()[2:] for p in re.findall(r"`([^`]+)`", row.rsplit("|", 2)[1])]


def test_every_place_in_the_table_exists():
    places = _table_places()
    assert places and all((ROOT / p).exists() for p in places), [p for p in places if not (ROOT / p).exists()]


def _installed_packages() -> dict[str, str]:
    """pyproject's package-dir mapping: installed name -> folder in the repository."""
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]


def test_every_package_is_in_the_table():
    places = _table_places()
    mapping = _installed_packages()
    tops = sorted({folder.split("/")[0] for folder in mapping.values()})
    assert tops and all(f"{p}/" in places for p in tops), (tops, places)
    on_disk = sorted(str(d.parent.relative_to(ROOT)) for d in ROOT.glob("*/**/__init__.py")
                     if not str(d.relative_to(ROOT)).startswith(("tests", "benchmarks", ".")))
    assert on_disk == sorted(mapping.values())  # a new package is installed and documented, or it is not a package


def test_one_name_is_installed():
    """Every installed package lives under nla_grpo, so nothing of this project shadows another project's ``shared``
    or ``evals`` in site-packages; the plugin entry point and the console script point into it."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert {name.split(".")[0] for name in _installed_packages()} == {"nla_grpo"}
    assert set(project["tool"]["setuptools"]["packages"]) == set(_installed_packages())
    assert project["project"]["scripts"]["nla-grpo"].startswith("nla_grpo.")
    assert all(v.startswith("nla_grpo.") for v in project["project"]["entry-points"]["vllm.general_plugins"].values())


# what a package may not import (anywhere in it, inside functions too): the layers stay a stack
IMPORT_BANS = {
    "shared": {"rollout", "critic", "learner", "orchestrator", "sft", "evals", "dataprep"},
    "rollout": {"critic", "learner", "orchestrator"},
    "critic": {"rollout", "learner", "orchestrator"},
    "learner": {"orchestrator", "rollout", "critic"},
    "dataprep": {"orchestrator", "rollout", "critic", "learner", "sft"},
    "sft": {"orchestrator", "dataprep", "evals"},
}


def _imported(path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(_part(node.module))
        elif isinstance(node, ast.Import):
            names.update(_part(a.name) for a in node.names)
    return names


def _part(module: str) -> str:
    """The top folder an import names: ``nla_grpo.rollout.actor`` -> rollout (the installed name's parts are the
    repository's folders); ``vllm.config`` -> vllm."""
    parts = module.split(".")
    return parts[1] if parts[0] == "nla_grpo" and len(parts) > 1 else parts[0]


def test_the_packages_import_only_downwards():
    crossings = [(str(f.relative_to(ROOT)), sorted(_imported(f) & banned))
                 for package, banned in IMPORT_BANS.items() for f in sorted((ROOT / package).rglob("*.py"))
                 if _imported(f) & banned]
    assert crossings == []


def test_every_package_says_what_lives_there():
    import ast

    packages = sorted(d for d in ROOT.iterdir() if (d / "__init__.py").is_file())
    silent = [d.name for d in packages if not ast.get_docstring(ast.parse((d / "__init__.py").read_text(encoding="utf-8")))]
    assert packages and silent == []


def test_the_configuration_reference_is_the_schema():
    """docs/configuration.md is what ``python -m nla_grpo.shared.config_reference`` writes from the schema: every field of every
    section (the weight_sync variants too), with its default; regenerate it after changing shared/config.py."""
    from nla_grpo.shared import config
    from nla_grpo.shared.config_reference import reference

    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == reference(), "docs/configuration.md is stale: python -m nla_grpo.shared.config_reference > docs/configuration.md"
    for section, field in config.RunConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, config.BaseModel):
            for key, sub in model.model_fields.items():
                nested = isinstance(sub.annotation, type) and issubclass(sub.annotation, config.BaseModel)
                assert (f"## `{section}.{key}`" if nested else f"| `{key}` |") in page, f"{section}.{key}"
    assert "| `max_loras` | int | `1` |" in page and "| `lora` | auto \\| adapter \\| merged | `auto` |" in page


def test_the_readme_is_a_first_screen_and_links_to_pages_that_exist():
    """README.md: what it is, the two commands on its first screen, a tour and links; every relative link (README
    and docs/) points at a file of the repository."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    first_screen = "\n".join(readme.splitlines()[:30])
    assert "bash deploy/demo-cpu.sh" in first_screen and "bash deploy/setup-cpu.sh && .venv/bin/python -m pytest -q tests" in first_screen
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: {target}"


PRODUCTION = ("shared", "dataprep", "sft", "rollout", "critic", "learner", "orchestrator", "evals", "nla_grpo")


def test_vllm_is_imported_only_in_its_folder():
    """rollout/vllm/ is the one place that knows vLLM: a vLLM upgrade that moves something is fixed there."""
    outside = [str(f.relative_to(ROOT)) for package in PRODUCTION for f in sorted((ROOT / package).rglob("*.py"))
               if "vllm" in _imported(f) and f.parent != ROOT / "rollout" / "vllm"]
    assert outside == []


def test_no_module_names_a_weight_sync_variant_outside_weight_sync():
    """The weight-sync variants are told apart in shared/weight_sync.py and the config's rules; elsewhere code asks
    the sender or receiver what it can do."""
    found = [f"{f.relative_to(ROOT)}:{i}" for package in PRODUCTION for f in sorted((ROOT / package).rglob("*.py"))
             if f.name not in ("weight_sync.py", "config.py", "config_reference.py")
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"""==\s*["'](cuda_ipc|nccl|file|ray_object)["']|["'](cuda_ipc|nccl|file|ray_object)["']\s*==""", line)]
    assert found == []



def test_no_two_modules_import_each_other():
    """Imports anywhere in a module (inside functions too) form no circle."""
    graph = {}
    for package in PRODUCTION:
        for f in (ROOT / package).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            name = name if package == "nla_grpo" else f"nla_grpo.{name}"
            graph[name] = f
    edges = {}
    import ast

    for name, f in graph.items():
        targets = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            targets.update(m for m in mods if m in graph and m != name and not name.startswith(m + "."))
        edges[name] = targets
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_sft_stages_use_only_public_names_of_other_modules():
    """SFT drives the learner, the critic and the rank groups through their public methods: a private one may change
    without a look at its callers elsewhere."""
    import ast

    found = []
    for f in sorted((ROOT / "sft").rglob("*.py")) + [ROOT / "orchestrator" / "sft_run.py"]:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                found += [f"{f.name}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{f.name}:{node.lineno}: .{node.attr}")
    assert found == []


def test_the_code_and_the_shipped_configs_say_what_and_why_not_which_machine_measured_what():
    """Figures with their machine and date live in benchmarks/RESULTS.md; the code and deploy/ do not name it."""
    import re

    history = re.compile(r"H100|H200|RESULTS")
    files = [f for d in ("shared", "dataprep", "sft", "rollout", "critic", "learner", "orchestrator", "evals", "nla_grpo")
             for f in sorted((ROOT / d).rglob("*.py"))] + sorted((ROOT / "deploy").glob("*.yaml"))
    found = [f"{f.relative_to(ROOT)}:{i}" for f in files
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if history.search(line)]
    assert files and found == [], found


def test_only_model_facts_reads_the_models_config_json():
    """``shared/model_facts.py`` is the one reader of a model directory's ``config.json`` (elsewhere the name only
    builds a path for a message or an existence check)."""
    import re

    reads = re.compile(r"AutoConfig|(?<![\w-])config\.json\"\)?\s*\)?\.(read_text|open)|json\.loads?\([^)]*(?<![\w-])config\.json")
    files = [f for d in ("shared", "dataprep", "sft", "rollout", "critic", "learner", "orchestrator", "evals", "nla_grpo")
             for f in sorted((ROOT / d).rglob("*.py")) if f != ROOT / "shared" / "model_facts.py"]
    found = [f"{f.relative_to(ROOT)}:{i}" for f in files
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if reads.search(line)]
    assert found == [], found
    assert reads.search('    return json.loads((Path(model_dir) / "config.json").read_text())')
    assert not reads.search('json.loads((Path(path) / "adapter_config.json").read_text())')  # PEFT's, not the model's
