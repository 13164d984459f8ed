# One job per shard: a cluster runs them in parallel, and a crash loses only the shard it was in.
rule teacher_topk:
    input:
        teacher="results/teacher.cmf",
        windows="results/data/windows.h5",
        code=nvg_sources("teacher_topk"),
    output:
        topk="results/teacher/topk.{shard}.h5",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/teacher_topk.{shard}.log",
    benchmark:
        "benchmarks/teacher_topk.{shard}.tsv"
    params:
        settings=settings("teacher_topk"),
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    shell:
        "python -m nvg.teacher_topk --teacher {input.teacher} --windows {input.windows} --shard {wildcards.shard} "
        "--out {output.topk} --settings {params.settings:q} > {log} 2>&1"
