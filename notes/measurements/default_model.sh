# Sourced by the H200 measurement scripts: the default model reaches the GPU machine in two halves
# (.gg1/part_aa in one call, .gg2/part_ab with the wheels of .whl/ in the next, made at once).
stash_first_half() {
  mkdir -p /root/gg && cp .gg1/part_aa /root/gg/ && ls -la /root/gg
}
join_and_convert() {   # the default model in /root/smollm2 (ENGINE_MODEL_DIR), the wheels on PYTHONPATH
  cat /root/gg/part_aa .gg2/part_ab > /root/gg/model.gguf
  pip install -q --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -1
  export PYTHONPATH=/tmp/site ENGINE_MODEL_DIR=/root/smollm2
  python3 -m engine.gguf_convert /root/gg/model.gguf /root/smollm2 2>&1 | tail -1
}
