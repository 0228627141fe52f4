#!/bin/bash
# Records every program of this folder on a real GPU at once (one process each), then packs the
# snapshots, figures and logs into one archive. On the device machine, from the repository root:
#   bash tests/gpu_programs/record_all.sh KIT "$OUT"
# KIT: a folder holding ../shared/gpu-truth/record.py and compiled_gpt.py (../shared does not
# travel to the device machine: copy them into a folder .git/info/exclude ignores and carry it).
set -u
KIT=$1; OUT=$2; P=tests/gpu_programs; D=$OUT/rec
mkdir -p "$D"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name())" > "$D/versions.txt" 2>&1
nvidia-smi > "$D/nvidia-smi.txt" 2>&1
rec() {  # rec NAME [ENV=...] -- script args...
  local name=$1; shift
  env "$@" > "$D/$name.log" 2>&1
}
R="python $KIT/record.py $D"
rec rnn_shapes $R rnn_shapes -- $P/rnn_shapes.py &
rec expandable_oom PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $R expandable_oom -- $P/expandable_oom.py &
rec mempools $R mempools -- $P/mempools.py &
rec topp_generate $R topp_generate -- $P/topp_generate.py &
rec nested_encoder $R nested_encoder -- $P/nested_encoder.py &
rec compiled_cnn_bn $R compiled_cnn_bn -- $P/compiled_cnn_bn.py &
rec compiled_dynamic $R compiled_dynamic -- $P/compiled_dynamic.py &
rec compiled_opt_step $R compiled_opt_step -- $P/compiled_opt_step.py &
rec pad_mm_decisions $R pad_mm_decisions -- $P/pad_mm_decisions.py &
rec compiled_lm_head $R compiled_lm_head -- $P/compiled_lm_head.py &
rec compiled_gpt_default $R compiled_gpt_default -- $KIT/compiled_gpt.py --mode default &
rec compiled_gpt_reduce_overhead $R compiled_gpt_reduce_overhead -- $KIT/compiled_gpt.py --mode reduce-overhead &
wait
grep -h RECORDED "$D"/*.log
(cd "$OUT" && tar -cJf recordings.tar.xz rec && rm -rf rec)
