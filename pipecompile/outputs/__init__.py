"""What a compiled pipeline shows and writes: reports, pictures, ONNX files, saved pipelines.

    report.py         the stage table of `print(pipe)`, the pass log of `explain()`, number formats
    presentation.py   what a pipeline shows its user, from its plan and its last step
    resolution.py     the request beside what the passes resolved (`explain()` ends with it)
    draw.py           pictures of a partition: blocks coloured by stage, cuts and their values
    cuts.py           the cuts of a staged program and the tensors that cross each one
    memory_report.py  the last step's measured memory per device beside the prediction
    onnx_export.py    one ONNX file per stage plus manifest.json
    onnx_run.py       run and check an exported ONNX pipeline
    persist.py        `pipe.save(directory)` and `pipecompile.load(directory)`
    persist_tensor.py the parts of save and load that differ for a tensor-parallel pipeline
    graph_code.py     graph modules as Python source, and back (saved pipelines)
    stage_check.py    a saved stage file checked to hold only what torch.fx writes
    treespec.py       pytree specs as text (a saved pipeline's input/output structures)
    metrics.py        `pipe.metrics()`: the last step as a flat dict of floats for a logger
    trace.py          one Chrome trace for the job: every rank's actions, sends joined to receives
    table.py          the plain-text table formatter every report uses
    progress_bar.py   compile's progress on the CLI's stderr: a bar on a terminal, else lines
"""
