# Optional (reconstruct.steps > 0): each student block learns to reproduce the teacher's block on the
# student's own hidden states, before end-to-end distillation.
rule reconstruct_blocks:
    input:
        student=encoded_student(),
        teacher="results/teacher.cmf",
        windows="results/data/windows.h5",
        **margin_grams("reconstruct"),
        code=nvg_sources("reconstruct_blocks"),
    output:
        cmf="results/student/reconstructed.cmf",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/reconstruct_blocks.log",
    benchmark:
        "benchmarks/reconstruct_blocks.tsv"
    params:
        settings=settings("reconstruct"),
        grams=grams_args,
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    shell:
        "python -m nvg.reconstruct_blocks --student {input.student} --teacher {input.teacher} "
        "--windows {input.windows}{params.grams} --out {output.cmf} --settings {params.settings:q} > {log} 2>&1"
