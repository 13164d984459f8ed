# {model} is `teacher` for the initial encode, `student` for re-encoding a given student (config student).
rule gram_capture:
    input:
        model=gram_model,
        windows="results/data/windows.h5",
        code=nvg_sources("gram_capture"),
    output:
        grams="results/grams/{model}.h5",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/gram_capture.{model}.log",
    benchmark:
        "benchmarks/gram_capture.{model}.tsv"
    params:
        settings=settings("grams"),
    wildcard_constraints:
        model="teacher|student",
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    shell:
        "python -m nvg.gram_capture --model {input.model} --windows {input.windows} --out {output.grams} "
        "--settings {params.settings:q} > {log} 2>&1"
