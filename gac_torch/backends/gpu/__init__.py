"""The GPU schedule layer both GPU targets (cuda, vortex) share: linalg on tensors -> bufferized
generics -> a kernel per generic, chosen from the target's ordered strategy list -> outlined
kernels + a host program as data. Importing this package loads no MLIR (program.py is plain data).

  irutil.py      IR navigation, folding index arithmetic, the one-block gpu.launch
  bufferize.py   elementwise fusion, tensors -> memrefs into the output buffers, clean-ups
  analysis.py    a generic's loop space (Generic), fills, contractions
  strategy.py    GpuLimits, Strategy (matcher + emitter), splicing a kernel template
  attention.py   gac.attention calls: to "attention" strategies, else inlined (on tensors)
  rows.py        row groups (reductions + the elementwise ops around them): to "rows" strategies
  strategies/    flash_attention, row, mma, simt_matmul, reduce (cuda); tiled_gemm (vortex)
  schedule.py    map_to_gpu: strategies, then `loops` / `serial` kernels
  outline.py     globals into kernels, run-time-sized buffers, gpu-kernel-outlining
  host.py        the host function read into a GpuProgram (program.py)
  stage.py       the "gpu" stage: schedule_module
"""
