# Encode every body linear at its planned budget; with config student, re-encode only what the plan changes.
rule budget_reencode:
    input:
        unpack(
            lambda wildcards: {"plan": config["plan"]} if config["plan"] else {}
        ),
        unpack(
            lambda wildcards: {"student": config["student"]} if config["student"] else {}
        ),
        teacher="results/teacher.cmf",
        grams="results/grams/student.h5" if config["student"] else "results/grams/teacher.h5",
        code=nvg_sources("budget_reencode"),
    output:
        cmf="results/student/encoded.cmf",
        report="results/student/encode.json",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/budget_reencode.log",
    benchmark:
        "benchmarks/budget_reencode.tsv"
    params:
        settings=json.dumps(encode_block(), sort_keys=True),
        # a config path reaches the shell only as one shlex-quoted word
        plan=f"--plan {shlex.quote(config['plan'])}" if config["plan"] else "",
        student=f"--student {shlex.quote(config['student'])}" if config["student"] else "",
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    shell:
        "python -m nvg.budget_reencode --teacher {input.teacher} --grams {input.grams} {params.plan} {params.student} "
        "--out {output.cmf} --report {output.report} --settings {params.settings:q} > {log} 2>&1"
