# nvg: compress a Llama-family teacher into binary low-rank (BLR) weights and heal it by distillation.
#   snakemake --cores 8 results/model.cmf
# Stages live in workflow/rules/<stage>.smk; each calls its step module `python -m nvg.<stage>`.
from snakemake.utils import min_version

min_version("9.1.0")


configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/import_teacher.smk"
include: "workflow/rules/generate_corpus.smk"
include: "workflow/rules/tokenize_windows.smk"
include: "workflow/rules/teacher_topk.smk"
include: "workflow/rules/gram_capture.smk"
include: "workflow/rules/budget_reencode.smk"
include: "workflow/rules/dtgma_cut.smk"
include: "workflow/rules/reconstruct_blocks.smk"
include: "workflow/rules/train_student.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


onerror:
    report_step_errors()


rule all:
    input:
        "results/model.cmf",
        "results/eval.json",
        "results/report.html",
        "results/report.png",
    default_target: True
