# Sourced by the `build` modes of scripts/gpu/*.sh (here, no GPU): the cust
# crate links libcuda, so it builds against the generated stub
# (.ci/stub-libcuda.sh); the binaries have no rpath and load the driver's
# real libcuda.so.1 on the GPU machine.
eval "$(bash "$ROOT/.ci/stub-libcuda.sh")"
# find_cuda_helper 0.2 only searches $CUDA_LIBRARY_PATH/lib64.
if [[ ! -e "$CUDA_LIBRARY_PATH/lib64" ]]; then
  mkdir -p /tmp/qmk-cust-stub && ln -sfn "$CUDA_LIBRARY_PATH" /tmp/qmk-cust-stub/lib64
  export CUDA_LIBRARY_PATH=/tmp/qmk-cust-stub
fi
