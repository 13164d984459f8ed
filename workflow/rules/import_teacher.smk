rule import_teacher:
    input:
        teacher=teacher_source(),
        code=nvg_sources("import_teacher"),
    output:
        cmf="results/teacher.cmf",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/import_teacher.log",
    benchmark:
        "benchmarks/import_teacher.tsv"
    params:
        dtype=config["teacher_dtype"],
    resources:
        mem_mb=8000,
        runtime=30,
    shell:
        "python -m nvg.import_teacher --source {input.teacher:q} --out {output.cmf} --dtype {params.dtype} > {log} 2>&1"
