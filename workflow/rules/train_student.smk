# Resumable: the step module keeps its state under train.state_root/<hash of inputs and settings>,
# outside the declared outputs, so a killed or timed-out job continues where it stopped on rerun/retry.
rule train_student:
    input:
        student=student_for_training(),
        windows="results/data/windows.h5",
        **training_targets(),
        code=nvg_sources("train_student"),
    output:
        cmf="results/train/trained.cmf",
        metrics="results/train/metrics.jsonl",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/train_student.log",
    benchmark:
        "benchmarks/train_student.tsv"
    params:
        settings=json.dumps(train_block(), sort_keys=True),
        teacher=config["teacher"],
        launcher=train_launcher(),
        targets=targets_args,
    threads: TORCH_THREADS
    resources:
        gpu=config["train"]["gpus"],
        mem_mb=32000,
        runtime=lambda wildcards, attempt: 240 * attempt,
    shell:
        "{params.launcher} -m nvg.train_student --student {input.student} --windows {input.windows} {params.targets} "
        "--teacher-name {params.teacher:q} --out {output.cmf} --metrics {output.metrics} "
        "--settings {params.settings:q} > {log} 2>&1"
