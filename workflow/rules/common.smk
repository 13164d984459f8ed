# Helpers shared by every rule: config validation, settings as params, step-module sources as inputs.
import ast
import json
import os
import shlex
import sys
import time
from pathlib import Path

from nvg.config import config_error
from nvg.errors import NvgError
from nvg.settings import SCHEMA_PATH, with_schema_defaults
from nvg.sources import GENERATED, resolve_path, text_files

# One line naming the file, the key and the problem, before any job; then the schema's defaults fill in
# every key left out.
if problem := config_error(config, SCHEMA_PATH, workflow.configfiles):
    sys.stderr.write(f"error: {problem}\n")
    sys.exit(2)
config.update(with_schema_defaults(config))

NVG = Path(workflow.basedir) / "nvg"
STARTED = time.time()
# Threads a PyTorch stage claims (Snakemake gives it at most --cores): torch already spreads one stage over
# every core it has, so stages side by side only contend. On 2 cores under `--cores 8`, one teacher pass
# beside the Gram capture took 137 s, where alone they take about 48 and 25 s.
TORCH_THREADS = 8


def report_step_errors():
    """On failure: the `nvg: error:` line of every job log this run wrote, in the terminal, where
    Snakemake itself only says "check log file(s)"."""
    for log in sorted(Path("logs").rglob("*.log")):
        if log.stat().st_mtime >= STARTED:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("nvg: error:"):
                    sys.stderr.write(f"{log}: {line}\n")


def settings(block, **extra):
    """The JSON a stage's step module reads: exactly its config block (a params value, so a change reruns it)."""
    return json.dumps({**config[block], **extra}, sort_keys=True)


# The embedding / LM head settings that each encode.embedding format does not read (with a plan file, whose
# lines may give either matrix any format, every one is read): left out of budget_reencode's params, so that
# changing, say, embedding_bpw under an f16 embedding does not re-encode every linear for nothing.
UNREAD_BY_EMBEDDING = {"f16": ("embedding_bpw", "embedding_damp", "embedding_shrink", "embedding_refit"),
                       "blr": ("embedding_damp", "embedding_shrink", "embedding_refit")}


def encode_block():
    """The encode block less what its embedding format does not read: budget_reencode's settings, and what
    export records of them."""
    block = dict(config["encode"])
    if not config["plan"]:
        for key in UNREAD_BY_EMBEDDING.get(block["embedding"], ("embedding_bpw",)):
            block.pop(key)
    return block


def train_block():
    """The train block as train_student reads it: without hidden_weight, hidden_decay, hidden_epochs and teacher_memo_gb
    under the cached top-k, which has no hidden states and no teacher to keep, so that a user who switches to topk need
    not zero the schema's 0.3 by hand, and changing them there reruns nothing."""
    block = dict(config["train"])
    if block["targets"] == "topk":
        block.pop("hidden_weight")
        block.pop("hidden_decay")
        block.pop("hidden_epochs")
        block.pop("teacher_memo_gb")
    return block


def corpus_block():
    """The generate_corpus block as its step module reads it: first_token is unread when prompts open the
    sequences, prompt_tokens when none do, so that changing either there reruns nothing."""
    block = dict(config["generate_corpus"])
    block.pop("first_token" if block["prompts"] else "prompt_tokens")
    return block


def nvg_sources(stage):
    """The step module's file and every nvg module it imports, transitively (the package's __init__
    runs for any of them): a code change reruns exactly the stages that run that code. Paths are
    relative to the working directory, so a moved or copied checkout keeps its cache."""
    seen, todo = set(), [stage, "__init__"]
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
    return sorted(os.path.relpath(NVG / f"{m}.py") for m in seen)


def teacher_source():
    """The teacher's file or folder (`pkg:<module>/<path>` resolved without importing the package); one
    error line before any job when it does not exist."""
    try:
        path = resolve_path(config["teacher"])
    except NvgError as e:
        sys.stderr.write(f"error: config teacher: {e}\n")
        sys.exit(2)
    if not path.exists():  # else an existing results/teacher.cmf would silently stand in for it
        sys.stderr.write(f"error: config teacher: {path}: not found\n")
        sys.exit(2)
    return str(path)


def text_inputs(key, specs):
    """The files the text sources `specs` (config `key`: data.sources, generate_corpus.prompts, evaluate.ood) read,
    as inputs of the stage reading them, so that an edited, added or removed file reruns it as a changed setting
    does (a source's path alone, in params, would not see its text change). One error line before any job when a
    source finds nothing."""
    files = set()
    for spec in specs:
        try:
            files.update(str(f) for f in text_files(spec))
        except NvgError as e:
            sys.stderr.write(f"error: config {key}: {e}\n")
            sys.exit(2)
    return sorted(files)


def train_launcher():
    """One process, or one per GPU under torchrun when `train.gpus` > 1 (data parallel, see nvg/distributed.py)."""
    gpus = config["train"]["gpus"]
    return "python" if gpus == 1 else f"torchrun --standalone --nproc_per_node {gpus}"


def generated_corpus():
    """The generate_corpus shards, when a data source is `generated` (the teacher's own text)."""
    if not any(src["path"] == GENERATED for src in config["data"]["sources"]):
        return []
    return expand("results/corpus/generated.{shard}.h5", shard=range(config["generate_corpus"]["shards"]))


def topk_shards():
    return expand("results/teacher/topk.{shard}.h5", shard=range(config["teacher_topk"]["shards"]))


def margin_grams(block):
    """{"grams": the teacher's input Grams} when `block`'s sign training (train or reconstruct) starts its
    latents from the encoder's margins, else {}."""
    signs = config[block]["signs"]
    return {"grams": "results/grams/teacher.h5"} if signs["enabled"] and signs["init"] == "margin" else {}


def grams_args(wildcards, input):
    """The option naming `margin_grams()`'s input, or nothing."""
    return f" --grams {shlex.quote(input.grams)}" if "grams" in input.keys() else ""


def training_targets():
    """train_student's targets: the cached top-k shards, or the teacher itself when it runs live (with its
    input Grams when sign training starts its latents from the encoder's margins)."""
    if config["train"]["targets"] == "live":
        return {"teacher": "results/teacher.cmf", **margin_grams("train")}
    return {"topk": topk_shards()}


def targets_args(wildcards, input):
    """The command-line options naming `training_targets()`."""
    if "teacher" in input.keys():
        return f"--teacher {shlex.quote(input.teacher)}{grams_args(wildcards, input)}"
    return "--topk " + " ".join(shlex.quote(p) for p in input.topk)


def encoded_student():
    """The DTG-MA cut student when `dtgma.keep` is set, else the encoded one."""
    if config["dtgma"]["keep"] is not None:
        return "results/student/masked.cmf"
    return "results/student/encoded.cmf"


def reconstructed_student():
    """{"reconstructed": its path} when `reconstruct.steps` > 0, else {}."""
    return {"reconstructed": "results/student/reconstructed.cmf"} if config["reconstruct"]["steps"] > 0 else {}


def reconstructed_args(wildcards, input):
    """evaluate's option naming `reconstructed_student()`, or nothing."""
    return f" --reconstructed {shlex.quote(input.reconstructed)}" if "reconstructed" in input.keys() else ""


def student_for_training():
    """The block-wise reconstructed student when `reconstruct.steps` > 0, else `encoded_student()`."""
    return reconstructed_student().get("reconstructed", encoded_student())


def chain_benchmarks():
    """The benchmark files of the stages that make this config's model, for evaluate's stage times: a stage
    this config skips (reconstruct_blocks at steps 0, teacher_topk under a live teacher, dtgma_cut unset) may
    still have an earlier run's file under benchmarks/."""
    stages = ["import_teacher", *(f"generate_corpus.{s}" for s in range(len(generated_corpus()))), "tokenize_windows",
              f"gram_capture.{'student' if config['student'] else 'teacher'}", "budget_reencode"]
    cut = config["dtgma"]["keep"] is not None
    stages += [f"teacher_topk.{s}" for s in range(len(topk_shards()))] if cut or "topk" in training_targets() else []
    stages += ["dtgma_cut"] if cut else []
    stages += ["reconstruct_blocks"] if reconstructed_student() else []
    return [f"benchmarks/{stage}.tsv" for stage in stages + ["train_student"]]


def gram_model(wildcards):
    if wildcards.model == "teacher":
        return "results/teacher.cmf"
    if wildcards.model == "student" and config["student"]:
        return config["student"]
    raise WorkflowError(f"grams for model {wildcards.model!r}: set config student to re-encode a student")
