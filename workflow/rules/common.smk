# Helpers shared by every rule: config validation, settings as params, step-module sources as inputs.
import ast
import json
import sys
from pathlib import Path

from snakemake.utils import validate

from nvg.config import config_error

SCHEMA = Path(workflow.basedir) / "workflow/schemas/config.schema.yaml"
# One line naming the file, the key and the problem, before any job; then Snakemake fills in defaults.
if problem := config_error(config, SCHEMA, workflow.configfiles):
    sys.stderr.write(f"error: {problem}\n")
    sys.exit(2)
validate(config, schema=str(SCHEMA))

NVG = Path(workflow.basedir) / "nvg"


def settings(block, **extra):
    """The JSON a stage's step module reads: exactly its config block (a params value, so a change reruns it)."""
    return json.dumps({**config[block], **extra}, sort_keys=True)


def nvg_sources(stage):
    """The step module's file and every nvg module it imports, transitively: a code change reruns the stage."""
    seen, todo = set(), [stage]
    while todo:
        mod = todo.pop()
        path = NVG / f"{mod}.py"
        if mod in seen or not path.exists():
            continue
        seen.add(mod)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nvg"):
                names = [node.module.split(".", 1)[1]] if "." in node.module else [a.name for a in node.names]
                todo.extend(names)
    return sorted(str(NVG / f"{m}.py") for m in seen)


def resolve_source(spec):
    """A path, or `pkg:<module>/<path>` inside an installed package (found without importing it)."""
    if not spec.startswith("pkg:"):
        return spec
    import importlib.util

    package, _, rel = spec[4:].partition("/")
    found = importlib.util.find_spec(package)
    if found is None:
        raise WorkflowError(f"config teacher: package {package!r} is not installed (see README: setup)")
    return str(Path(list(found.submodule_search_locations)[0]) / rel)


def train_launcher():
    """One process, or one per GPU under torchrun when `train.gpus` > 1 (data parallel, see nvg/distributed.py)."""
    gpus = config["train"]["gpus"]
    return "python" if gpus == 1 else f"torchrun --standalone --nproc_per_node {gpus}"


def topk_shards():
    return expand("results/teacher/topk.{shard}.h5", shard=range(config["teacher_topk"]["shards"]))


def student_for_training():
    """The DTG-MA cut student when `dtgma.keep` is set, else the encoded one."""
    if config["dtgma"]["keep"] is not None:
        return "results/student/masked.cmf"
    return "results/student/encoded.cmf"


def gram_model(wildcards):
    if wildcards.model == "teacher":
        return "results/teacher.cmf"
    if wildcards.model == "student" and config["student"]:
        return config["student"]
    raise WorkflowError(f"grams for model {wildcards.model!r}: set config student to re-encode a student")
