#!/bin/bash
# A Megatron-LM launch script for Llama-3-70B pre-training (model shape from Meta's Llama 3
# model card: 80 layers, hidden 8192, FFN 28672, 64 heads with 8 KV groups, vocabulary
# 128256, 8K context) on 64 nodes of 8 H100s: TP 8, PP 4 with 5 layers per virtual stage,
# distributed optimizer, sequence parallelism. Input of `pipeplan import-megatron`.
#SBATCH --nodes=64 --ntasks-per-node=8 --exclusive
export CUDA_DEVICE_MAX_CONNECTIONS=1
TP=8
PP=4
GBS=${GBS:-1024}
MODEL_ARGS=(
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --seq-length 8192
    --max-position-embeddings 8192
    --swiglu
    --untie-embeddings-and-output-weights
    --padded-vocab-size 128256
)
options=" \
  --tensor-model-parallel-size $TP \
  --pipeline-model-parallel-size $PP \
  --num-layers-per-virtual-pipeline-stage 5 \
  --micro-batch-size 1 \
  --global-batch-size $GBS \
  --use-distributed-optimizer \
  --overlap-grad-reduce \
  --sequence-parallel \
  --bf16 \
  --lr 1.0e-4 --clip-grad 1.0"
torchrun --nproc_per_node 8 --nnodes $SLURM_NNODES pretrain_gpt.py ${MODEL_ARGS[@]} $options
