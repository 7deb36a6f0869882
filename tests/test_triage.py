"""Log triage (tasks.recovery.triage) on real excerpts of public failure reports
(tests/data/triage/<class>/, sources and the reasoning behind each expectation in SOURCES.md) and
on focused synthetic cases for each rule, including the texts our local training job prints."""

import calendar
import json
from pathlib import Path

import pytest

from tasks.errors import Unreadable, UsageError
from tasks.recovery.triage import CRITICAL_XIDS, FailureClass, triage
from tests.conftest import ROOT

DATA = Path(__file__).parent / "data" / "triage"

# Every fixture: (path under DATA, class, a substring of the first error or None, suspect nodes,
# the file the first error is in for a multirank directory). The first-error substrings are the
# initiating lines of SOURCES.md.
FIXTURES = [
    # hardware
    (
        "hardware/ecc_uncorrectable_cuctxcreate_slurm_node_mfc_pr1748.log",
        "hardware",
        "Accelerator Fatal Error: call to cuCtxCreate returned error 214",
        [],
    ),
    (
        "hardware/ecc_uncorrectable_nccl_watchdog_rank12_multinode_pytorch_issue113128.log",
        "hardware",
        "[PG 0 (default_pg) Rank 12] Process group watchdog thread terminated with exception: "
        "CUDA error: uncorrectable ECC error encountered",
        [],
    ),
    (
        "hardware/ecc_uncorrectable_nccl_watchdog_rank1_2xh100_sdscripts_issue1434.log",
        "hardware",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        [],
    ),
    (
        "hardware/ecc_uncorrectable_node_dgk713_jadehpc_issue194.log",
        "hardware",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        [],
    ),
    (
        "hardware/ecc_uncorrectable_torchrun_sigterm_accelerate_issue1192.log",
        "hardware",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        [],
    ),
    (
        "hardware/fallen_off_bus_no_xid_dmesg_nvsentinel_issue155_kernel.log",
        "hardware",
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        [],
    ),
    (
        "hardware/xid45_after_xid149_xid145_nvlink_openkm_issue1150_kernel.log",
        "hardware",
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 "
        "caused by previous Xid 149",
        [],
    ),
    (
        "hardware/xid48_dbe_xid64_worker4_gpuoperator_issue1146_kernel.log",
        "hardware",
        "NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error",
        ["worker4"],
    ),
    # network
    (
        "network/ib_error12_ncclremoteerror_oneline_alpaca_issue207.log",
        "network",
        "Last error: NET/IB : Got completion from peer 11.214.147.122<39138> with error 12",
        [],
    ),
    (
        "network/ib_error12_ncclsystemerror_phlrr4036_deepspeed_issue2931.log",
        "network",
        "PHLRR4036:24141:24296 [2] ib_plugin.c:978 NCCL WARN NET/IB : Got completion from peer "
        "10.226.98.98<48598> with error 12",
        ["PHLRR4036"],
    ),
    (
        "network/ib_error4_vendor81_connection_closed_kolyoz_nccltests_issue252.log",
        "network",
        "kolyoz2:25146:25854 [0] ib_plugin.c:1105 NCCL WARN NET/IB : Got completion from peer "
        "10.0.35.1<49189>",
        ["kolyoz2"],
    ),
    (
        "network/ib_error4_vendor81_h100_multihost_nccl_issue928.log",
        "network",
        "H100-2:19989:20082 [1] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
        "fe80::966d:ae03:8b:df78%ib0<53249> with error 4",
        ["H100-2", "H100-1", "H100-5"],
    ),
    (
        "network/ib_port_error_async_event_vllm_tp_llmd_issue191.log",
        "network",
        "[2025-09-17 15:16:23] ms-pd-llm-d-modelservice-prefill-2:311:405 [0] transport/net_ib.cc:199 "
        "NCCL WARN NET/IB : mlx5_32:1 Got async error event: port error",
        ["ms-pd-llm-d-modelservice-prefill-2"],
    ),
    (
        "network/ib_status12_status5_ncclremoteerror_rank4_deepspeed_issue6875.log",
        "network",
        "50428e4af543:34610:36821 [4] ib_plugin.c:1673 NCCL WARN NET/IB: Got completion from peer "
        "10.0.1.23<47140> with status=12",
        ["50428e4af543"],
    ),
    (
        "network/ib_status12_then_status5_hostname_test_nccl_issue1814.log",
        "network",
        "hostname-test:984:1357 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer "
        "172.36.143.59<44206> with status=12",
        ["hostname-test"],
    ),
    (
        "network/ib_status12_vendor129_kpddp_worker_nccl_issue1405.log",
        "network",
        "kp-ddp-worker-0:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer "
        "10.216.210.236<54862> with status=12 opcode=0",
        ["kp-ddp-worker-0"],
    ),
    # numerics
    (
        "numerics/numerics_deepspeed_overflow_loss_scale_collapse_alpaca_issue534.log",
        "numerics",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 64, reducing to 32",
        [],
    ),
    (
        "numerics/numerics_found_nan_local_grad_norm_pai_megatron_issue366.log",
        "numerics",
        "AssertionError: Rank 11: found NaN in local grad norm in backward pass",
        [],
    ),
    (
        "numerics/numerics_grad_norm_nan_dsv4_megatron_bridge_issue5306.log",
        "numerics",
        "loss scale: 1.0 | grad norm: nan |",
        [],
    ),
    (
        "numerics/numerics_grad_norm_nan_megatron_deepspeed_issue396.log",
        "numerics",
        " iteration     5426/  250000 | consumed samples:        43408 |",
        [],
    ),
    (
        "numerics/numerics_loss_nan_nanogpt_issue215.log",
        "numerics",
        "2023-03-22 09:32:52 iter 3010: loss nan, time 1019.95ms, mfu 14.12%",
        [],
    ),
    (
        "numerics/numerics_model_diverged_loss_nan_bert_dle_issue529.log",
        "numerics",
        "ERROR:tensorflow:Model diverged with loss = NaN.",
        [],
    ),
    (
        "numerics/numerics_rerun_nan_local_grad_norm_nemo_issue14348.log",
        "numerics",
        "RuntimeError: Rank 2, node dcfai-xe9680-01, device 2, iteration -1: Unexpected result nan",
        ["dcfai-xe9680-01"],
    ),
    (
        # Reproducible on the same GPU: Megatron wants the iteration rerun on another one.
        "numerics/numerics_rerun_first_reproducible_megatron_issue5026.log",
        "numerics",
        "ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 3 at iteration #3",
        ["core-ci-test-1779833921-task-1-0"],
    ),
    (
        "numerics/numerics_rerun_nan_local_grad_norm_nemo_issue15108.log",
        "numerics",
        "RuntimeError: Rank 0, node f0f511ad6b95, device 0, iteration -1: Unexpected result nan",
        ["f0f511ad6b95"],
    ),
    # oom
    (
        "oom/oom_fsdp_p4d_torchrun_speechgpt_issue49.log",
        "oom",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 172.00 MiB.",
        [],
    ),
    (
        "oom/oom_nccl_calloc_allgather_nccl_issue962.log",
        "oom",
        "node:2134736:2285781 [0] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
        ["node"],  # the host really is called "node"
    ),
    (
        "oom/oom_nccl_calloc_multinode_mixed_nccl_issue1235.log",
        "oom",
        "ng30903:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
        ["ng30903"],
    ),
    (
        "oom/oom_nccl_cuda_failure_load_optim_megatron_issue1509.log",
        "oom",
        "TENCENT64:47604:53083 [0] include/alloc.h:103 NCCL WARN Cuda failure 2 'out of memory'",
        ["TENCENT64"],
    ),
    (
        "oom/oom_nccl_enqueue_cuda_failure_opensora_issue386.log",
        "oom",
        "ins-7df6eojsifuykig9:3018451:3018451 [0] enqueue.cc:1085 NCCL WARN Cuda failure 'out of memory'",
        ["ins-7df6eojsifuykig9"],
    ),
    (
        "oom/oom_optimizer_step_colossalai_issue3509.log",
        "oom",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.12 GiB (GPU 5;",
        [],
    ),
    (
        "oom/oom_runtimeerror_model_parallel_summit_deepspeed_issue115.log",
        "oom",
        "RuntimeError: CUDA out of memory. Tried to allocate 18.00 MiB (GPU 3;",
        [],
    ),
    (
        "oom/oom_tried_to_allocate_multirank_msswift_issue5943.log",
        "oom",
        "[rank15]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.63 GiB.",
        [],
    ),
    # software
    (
        "software/software_dcp_missing_key_checkpoint_load_torchtitan_issue2622.log",
        "software",
        "[rank0]: RuntimeError: Missing key in checkpoint state_dict: layer.weight.",
        [],
    ),
    (
        "software/software_device_side_assert_index_select_megatron_deepspeed_issue207.log",
        "software",
        "thread: [121,0,0] Assertion `srcIndex < srcSelectDimSize` failed.",
        [],
    ),
    (
        "software/software_illegal_memory_access_megatron_rng_miles_issue308.log",
        "software",
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
        [],
    ),
    (
        "software/software_illegal_memory_access_nccl_watchdog_axolotl_issue1473.log",
        "software",
        "[rank7]:[E ProcessGroupNCCL.cpp:1182] [Rank 7] NCCL watchdog thread terminated with exception: "
        "CUDA error: an illegal memory access was encountered",
        [],
    ),
    (
        "software/software_keyerror_load_checkpoint_megatron_issue126.log",
        "software",
        "KeyError: 'query_model'",
        [],
    ),
    (
        "software/software_same_device_deepspeed_zero3_huatuogpt_issue9.log",
        "software",
        "[rank0]: RuntimeError: Expected all tensors to be on the same device",
        [],
    ),
    # hang
    (
        "hang/hang_allgather_subgroup_timeout_2node_pytorch_issue134006_slurm.out",
        "hang",
        # torchrun's summary comes before srun's line, and names the global rank too.
        "Root Cause (first observed failure): rank 4 (local_rank: 0) on workergpu008.cm.cluster, exitcode 1",
        ["workergpu008"],
    ),
    (
        "hang/hang_allreduce_timeout_8rank_v100_ofa_issue271.log",
        "hang",
        "[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=469508",
        [],
    ),
    (
        "hang/hang_allreduce_timeout_llama70b_32rank_litgpt_issue1819.log",
        "hang",
        "[rank31]:[E1114 18:35:13.955775341 ProcessGroupNCCL.cpp:607] [Rank 31] Watchdog caught collective",
        [],
    ),
    (
        "hang/hang_allreduce_timeout_moe_megatron_issue735.log",
        "hang",
        "[rank2]:[E ProcessGroupNCCL.cpp:754] [Rank 2] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=305",
        [],
    ),
    (
        "hang/hang_broadcast_timeout_litgpt_lightning_issue20434_slurm.out",
        "hang",
        "[rank3]:[E1119 13:21:12.512781555 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST",
        [],
    ),
    (
        "hang/hang_heartbeat_monitor_watchdog_stuck_deim_issue105.log",
        "hang",
        "[rank1]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 1] Heartbeat monitor timed out!",
        [],
    ),
    (
        "hang/hang_ncclUniqueId_store_wait_timeout_nemo_issue14399.log",
        "hang",
        "[rank1]: torch.distributed.DistBackendError: [1] is setting up NCCL communicator",
        [],
    ),
    (
        "hang/hang_reduce_timeout_multinode_dinov2_milabench_pr269.log",
        "hang",
        "dinov2-giant-nodes.cn-d004 [stderr] [rank14]:[E909 09:55:29.307629539 ProcessGroupNCCL.cpp:607] "
        "[Rank 14] Watchdog caught collective operation timeout:",
        [],
    ),
    # preempted: never a suspect (a preempted node is not faulty)
    (
        "preempted/preempted_gcp_spot_termination_v100_worker_translations_issue964.log",
        "preempted",
        "GCP Metadata Service says termination is imminent",
        [],
    ),
    (
        "preempted/preempted_job_cancelled_no_reason_lightning_ddp_torchmetrics_issue2300.log",
        "preempted",
        "slurmstepd: error: *** JOB 168885 ON scn67-10g CANCELLED AT 2023-08-31T18:04:42 ***",
        [],
    ),
    (
        "preempted/preempted_job_requeue_sigusr2_submitit_issue1708_slurm.out",
        "preempted",
        "*** JOB 608 ON SERVER_NAME CANCELLED AT 2022-08-12T02:06:12 DUE TO JOB REQUEUE ***",
        [],
    ),
    (
        "preempted/preempted_skypilot_spot_cluster_preempted_bert_pr804.log",
        "preempted",
        "I 05-04 00:52:46 controller.py:100] The cluster is preempted.",
        [],
    ),
    (
        "preempted/preempted_slurm_due_to_preemption_submitit_issue1613.log",
        "preempted",
        "*** JOB 37361369 ON learnfair5146 CANCELLED AT 2021-03-15T18:00:46 DUE TO PREEMPTION ***",
        [],
    ),
    (
        "preempted/preempted_slurm_time_limit_lightning_issue20542.log",
        "preempted",
        "*** STEP 55595933.0 ON maestro-3017 CANCELLED AT 2025-01-10T15:27:25 DUE TO TIME LIMIT ***",
        [],
    ),
    (
        "preempted/preempted_time_limit_2node_srun_desitarget_issue628_slurm.out",
        "preempted",
        "*** STEP 32233190.0 ON nid01934 CANCELLED AT 2020-07-03T02:59:56 DUE TO TIME LIMIT ***",
        [],
    ),
    (
        "preempted/preempted_time_limit_host_redacted_zetta_issue671.log",
        "preempted",
        "*** JOB 494583 ON ... CANCELLED AT 2024-04-20T09:09:37 DUE TO TIME LIMIT ***",
        [],
    ),
    # save-failed: a checkpoint write that failed (tests/data/triage/SOURCES-saves.md); a full disk
    # often shows only as torch's zip writer failing, without the errno
    ("save-failed/nospace_dolly_139.log", "save-failed", "OSError: [Errno 28] No space left on device", []),
    (
        "save-failed/writeerror_h2o-llmstudio_214.log",
        "save-failed",
        "PytorchStreamWriter failed writing file data/228: file write failed",
        [],
    ),
    (
        "save-failed/writeerror_moss_270.log",
        "save-failed",
        "PytorchStreamWriter failed writing file data/5: file write failed",
        [],
    ),
    (
        "save-failed/writeerror_simplerl-reason_19.log",
        "save-failed",
        "PytorchStreamWriter failed writing file data/0: file write failed",
        [],
    ),
    # Megatron-Core's async writer process died: its frames (async_loop) under a CUDA error
    ("save-failed/asyncworker_megatron-lm_1707.log", "save-failed", "TORCH_USE_CUDA_DSA", []),
    # save-stalled: the job hung inside a save (its words, or a stack caught inside one)
    (
        "save-stalled/stalled_ace_851.log",
        "save-stalled",
        "Saving latest checkpoint model trained for 3 complete epochs",
        [],
    ),
    (
        "save-stalled/stalled_megatron-lm_2422.log",
        "save-stalled",
        "is_current_async_call_done (core/dist_checkpointing/strategies/async_utils.py:236)",
        [],
    ),
    (
        "save-stalled/stalled_torchtitan_3065.log",
        "save-stalled",
        "Saving the checkpoint (or staging if async is enabled).",
        [],
    ),
    (
        "save-stalled/stalled_lightning_19045.log",
        "save-stalled",
        'trainer.py", line 1384, in save_checkpoint',
        [],
    ),
    # unknown: nothing to recognise, nothing guessed
    # (an async save's process starting its traceback, cut off before any error: nothing to name)
    ("unknown/unknown_asyncworker_skyrl_pr1960.log", "unknown", None, []),
    ("unknown/unknown_deepspeed_initial_loss_scale_search_deepspeed_issue386.log", "unknown", None, []),
    ("unknown/unknown_filesystem_quota_df_marbits_issue141.log", "unknown", None, []),
    ("unknown/unknown_megatron_iterations_no_error_megatron_llm_issue11.log", "unknown", None, []),
    ("unknown/unknown_sbatch_node_configuration_not_available_pman_issue200.log", "unknown", None, []),
    ("unknown/unknown_tokenizer_length_warning_only_lisa_issue18.log", "unknown", None, []),
    # multirank: one report split per rank/process/host; (.., the file holding the first error)
    (
        "multirank/hang_task_exit_workergpu008_pytorch_issue134006",
        "hang",
        # torchrun's summary comes before srun's line, and names the global rank too.
        "Root Cause (first observed failure): rank 4 (local_rank: 0) on workergpu008.cm.cluster, exitcode 1",
        ["workergpu008"],
        "slurm.out",
    ),
    (
        "multirank/hardware_ecc_worker_sigterm_agent_accelerate_issue1192",
        "hardware",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        [],
        "worker.log",
    ),
    (
        "multirank/network_ib_error4_kolyoz2_nccltests_issue252",
        "network",
        "kolyoz2:25146:25854 [0] ib_plugin.c:1105 NCCL WARN NET/IB : Got completion from peer "
        "10.0.35.1<49189>",
        ["kolyoz2"],
        "kolyoz2.log",
    ),
    (
        "multirank/oom_nccl_calloc_localrank3_ng30903_nccl_issue1235",
        "oom",
        "ng30903:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
        ["ng30903"],
        "localrank3.log",
    ),
    # grown for issue 24 (item 7): 37 more excerpts, one report each (SOURCES.md)
    (
        "hang/hang_allreduce_timeout_3rank_basicsr_issue737.log",
        "hang",
        "[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective oper",
        [],
    ),
    (
        "hang/hang_reduce_scatter_timeout_llamafactory_issue6269.log",
        "hang",
        "[rank0]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective ope",
        [],
    ),
    (
        "hang/hang_allreduce_timeout_line_numbered_llamafactory_issue7396.log",
        "hang",
        "[80746] [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collect",
        [],
    ),
    (
        "hang/hang_allreduce_timeout_7h_nemo_lightning_pytorch_issue118369.log",
        "hang",
        "[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum",
        [],
    ),
    (
        "hang/hang_ncclinternalerror_connection_closed_by_remote_peer_nccl_issue1514.log",
        "hang",
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.",
        [],
    ),
    (
        "hang/hang_task_exit_then_step_cancelled_2node_submitit_deit_issue102_slurm.out",
        "hang",
        "srun: error: learnfair0824: task 5: Exited with exit code 1",
        ["learnfair0824"],
    ),
    (
        "hang/hang_allreduce_numel1_timeout_slurm_llm_training_issue7.log",
        "hang",
        "[rank2]:[E ProcessGroupNCCL.cpp:563] [Rank 2] Watchdog caught collective operation timeout: WorkNCC",
        [],
    ),
    (
        "hardware/ecc_cuda_runtime_error_39_host_allocator_semseg_issue33.log",
        "hardware",
        "RuntimeError: cuda runtime error (39) : uncorrectable ECC error encountered at /pytorch/aten/src/TH",
        [],
    ),
    (
        "hardware/ecc_uncorrectable_two_lines_finetune_alpacalora_issue123.log",
        "hardware",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        [],
    ),
    (
        "hardware/ecc_uncorrectable_after_two_weeks_api_server_chatglm3_issue681.log",
        "hardware",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        [],
    ),
    (
        "network/ncclremoteerror_socket_reset_v100_ddp_nccl_issue2076.log",
        "network",
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematur",
        [],
    ),
    (
        "network/ib_async_event_port_error_flapping_link_nccl_issue905.log",
        "network",
        "NCCL WARN NET/IB : Got async event : port error",
        [],
    ),
    (
        "network/ibv_create_qp_failed_tf_slurm_pyxis_hai_a100_3_nccl_issue562.log",
        "network",
        "hai-a100-3:3778851:3779883 [4] ibvwrap.c:130 NCCL WARN Call to ibv_create_qp failed",
        ["hai-a100-3"],
    ),
    (
        "numerics/numerics_grad_norm_nan_mmengine_xtuner_issue187.log",
        "numerics",
        "10/30 22:19:57 - mmengine - INFO - Epoch(train) [1][240/735]  lr: 1.9813e-04  eta: 2:44:49  time: 2",
        [],
    ),
    (
        "numerics/numerics_loss_nan_epoch_gradnorm_tf_issue17.log",
        "numerics",
        "epoch: 3451 loss: nan",
        [],
    ),
    (
        "numerics/numerics_loss_scale_minimum_interleaved_launcher_kill_llamafactory_issue251.log",
        "numerics",
        ": Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
        [],
    ),
    (
        "numerics/numerics_loss_scale_minimum_one_line_llamafactory_issue315.log",
        "numerics",
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
        [],
    ),
    (
        "numerics/numerics_loss_scale_minimum_reward_model_deepspeed_chat_issue418.log",
        "numerics",
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
        [],
    ),
    (
        "numerics/numerics_fairseq_overflow_loss_scale_collapse_nmt_fairseq_issue512.log",
        "numerics",
        "| WARNING: overflow detected, setting loss scale to: 0.25",
        [],
    ),
    (
        "oom/oom_capacty_one_line_mgfn_issue35.log",
        "oom",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a total capa",
        [],
    ),
    (
        "oom/oom_batch_training_mmedrag_issue38.log",
        "oom",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total cap",
        [],
    ),
    (
        "oom/oom_cuda_error_out_of_memory_model_to_llmc_issue206.log",
        "oom",
        "RuntimeError: CUDA error: out of memory",
        [],
    ),
    (
        "oom/oom_nccl_init_cuda_failure_thd_c460c041_pytorch_pr4921.log",
        "oom",
        "c460c041:101211:106353 [0] init.cu:218 WARN Cuda failure 'out of memory'",
        ["c460c041"],
    ),
    (
        "oom/oom_zero2_optimizer_states_megatron_gpt2_deepspeed_issue237.log",
        "oom",
        "RuntimeError: CUDA out of memory. Tried to allocate 8.52 GiB (GPU 0; 31.72 GiB total capacity; 25.5",
        [],
    ),
    (
        "oom/oom_outofmemoryerror_training_log_deepspeed_chat_issue279.log",
        "oom",
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 786.00 MiB (GPU 0; 39.56 GiB total capacity",
        [],
    ),
    (
        "oom/oom_host_cgroup_oom_killer_dataloader_worker_opennmt_tutorial_issue6.log",
        "oom",
        "Memory cgroup out of memory: Killed process 629 (onmt_train) total-vm:14119556kB, anon-rss:6538204k",
        [],
    ),
    (
        "software/software_illegal_memory_access_watchdog_ray_vllm_issue4108.log",
        "software",
        "[E ProcessGroupNCCL.cpp:916] [Rank 0] NCCL watchdog thread terminated with exception: CUDA error: a",
        [],
    ),
    (
        "software/software_nccl_cuda_failure_invalid_argument_ray_n176_nccl_issue1283.log",
        "software",
        "(train_rft pid=2657296) 2024-05-11 14:10:52.227 n176-080-198:2657296:2658232 [0] include/alloc.h:10",
        ["n176-080-198"],
    ),
    (
        "software/software_nccl_cuda_failure_invalid_argument_mpirun_tomte401_megatron_nccl_issue957.log",
        "software",
        "Fri Aug 11 12:31:45 2023[1,0]<stdout>:tomte401:1850301:1881341 [0] transport.cc:154 NCCL WARN Cuda",
        ["tomte401"],
    ),
    (
        "software/software_illegal_memory_access_synchronize_megatron_codegeex_issue160.log",
        "software",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        [],
    ),
    (
        "software/software_illegal_memory_access_logger_prefix_regtr_issue33.log",
        "software",
        "06/26 18:54:31 [ERROR] trainer - <class 'RuntimeError'> at trainer.py:101 - CUDA error: an illegal",
        [],
    ),
    (
        "software/software_cuda_runtime_error_77_thc_depthawarecnn_issue12.log",
        "software",
        "RuntimeError: cuda runtime error (77) : an illegal memory access was encountered at /pytorch/aten/s",
        [],
    ),
    (
        "software/software_worker_sigsegv_exitcode_minus11_torchrun_nvdiffrecmc_issue21.log",
        "software",
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -11) local_rank: 1 (pid: 5528",
        [],
    ),
    (
        "software/software_device_side_assert_nll_n_classes_reid_issue372.log",
        "software",
        "/pytorch/aten/src/THCUNN/ClassNLLCriterion.cu:108: cunn_ClassNLLCriterion_updateOutput_kernel: bloc",
        [],
    ),
    (
        "software/software_thcudacheck_device_side_assert_59_encoding_issue23.log",
        "software",
        "  THCudaCheck FAIL file=/pytorch/torch/lib/THC/generic/THCStorage.cu line=58 error=59 : device-side",
        [],
    ),
    (
        "software/software_xid31_mmu_fault_dmesg_tinygrad_issue6947_kernel.log",
        "software",
        "[22859.081860] NVRM: Xid (PCI:0000:01:00): 31, pid=14292, name=python, Ch 00000030, intr 00000000.",
        [],
    ),
    (
        "unknown/unknown_megatron_bridge_healthy_iterations_mtp_loss_issue4024.log",
        "unknown",
        None,
        [],
    ),
]


# Cases triage gets wrong, with the reason (SOURCES.md, "Known misses", gives the same reason):
# each row of FIXTURES keeps the right label; these are counted as misses by
# tests/triage_accuracy.py, and a fix that makes one right must take it off this list.
KNOWN_MISSES: dict[str, str] = {}


def paths_of(relative: str) -> list[Path]:
    path = DATA / relative
    return sorted(path.iterdir()) if path.is_dir() else [path]


def write(tmp_path: Path, name: str, *lines: str) -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_table_covers_every_fixture_on_disk():
    on_disk = {
        str(p.relative_to(DATA))
        for d in DATA.iterdir()
        if d.is_dir()
        for p in d.iterdir()
        if d.name != "multirank" or p.is_dir()
    }
    assert on_disk == {row[0] for row in FIXTURES}
    assert len({row[0] for row in FIXTURES}) == len(FIXTURES)
    counts = {cls: sum(1 for row in FIXTURES if row[0].startswith(cls + "/")) for cls in FailureClass}
    assert counts["unknown"] >= 5
    assert sum(1 for row in FIXTURES if row[0].startswith("multirank/")) >= 3


@pytest.mark.parametrize("row", FIXTURES, ids=[row[0].split("/")[-1][:70] for row in FIXTURES])
def test_real_fixture(row):
    relative, cls, first, suspects = row[:4]
    paths = paths_of(relative)
    result = triage(paths)
    if relative in KNOWN_MISSES:
        assert (result.cls, result.suspect_nodes) != (cls, suspects), f"{relative} is right now"
        return
    assert result.cls == cls
    assert result.suspect_nodes == suspects
    if first is None:
        assert result.first_error is None
        assert result.evidence == []
        assert "nothing recognised" in result.reason
        return
    assert result.first_error is not None
    assert first in result.first_error.text
    # The line number points at that very line of that file (torchrun's summary: at its first
    # line, which the text continues with the block's fields).
    lines = Path(result.first_error.file).read_text(errors="replace").splitlines()
    assert result.first_error.text.startswith(lines[result.first_error.line - 1])
    assert result.first_error in result.evidence
    if len(row) == 5:
        assert Path(result.first_error.file).name == row[4]
    if cls != "hang":
        assert result.first_error.kind == "root"
        assert result.first_error.cls == cls


def test_accuracy_on_the_labelled_corpus(capsys):
    """Every labelled case is right, or a known miss whose reason SOURCES.md gives; the numbers
    (`python -m tests.triage_accuracy`) are those the docs print."""
    from tests.triage_accuracy import measure

    accuracy = measure()
    missed = {o.case for o in accuracy.outcomes if not o.class_right or not o.suspects_right}
    assert missed == set(KNOWN_MISSES)
    sources = (DATA / "SOURCES.md").read_text()
    known = sources[sources.index("## Known misses") :]
    for case, reason in KNOWN_MISSES.items():
        assert f"`{case}`" in known and reason in known
    assert accuracy.cases == len(FIXTURES)
    with capsys.disabled():
        print(f"\ntriage accuracy on {accuracy.cases} labelled cases\n{accuracy.report()}")


def test_nan_attribution_names_the_gpu_or_the_data_and_the_iteration(capsys):
    """Every rerun state machine's verdict (the public first reruns, and the transient, the
    reproduced-on-the-same-GPU and the data verdicts made by Megatron-LM's own loop here, log and
    tracker file alike) gets its class, the GPU's node and the iteration right."""
    from tests.triage_accuracy import measure_nans, nan_report

    verdicts = measure_nans()
    assert {v.label[0] for v in verdicts} == {"numerics", "hardware", "data"}
    assert [v.case for v in verdicts if not v.right] == []
    with capsys.disabled():
        print("\n" + nan_report(verdicts))


def test_real_numerics_fixtures_name_the_iteration_of_the_anomaly():
    found = {
        name: triage([DATA / "numerics" / name])
        for name in (
            "numerics_grad_norm_nan_megatron_deepspeed_issue396.log",
            "numerics_grad_norm_nan_dsv4_megatron_bridge_issue5306.log",
            "numerics_loss_nan_nanogpt_issue215.log",
            "numerics_rerun_nan_local_grad_norm_nemo_issue14348.log",
        )
    }
    as_pairs = {name: (t.anomaly_iteration, t.iteration) for name, t in found.items()}
    assert as_pairs == {
        "numerics_grad_norm_nan_megatron_deepspeed_issue396.log": (5426, 5428),
        # the record is wrapped over four lines: "grad norm: nan" belongs to "iteration 5/50"
        "numerics_grad_norm_nan_dsv4_megatron_bridge_issue5306.log": (5, 5),
        "numerics_loss_nan_nanogpt_issue215.log": (3010, 3060),
        # Megatron printed "iteration -1" and no iteration line is in the excerpt
        "numerics_rerun_nan_local_grad_norm_nemo_issue14348.log": (None, None),
    }


def test_a_plain_training_log_is_unknown_but_its_last_iteration_is_read():
    result = triage([DATA / "unknown" / "unknown_megatron_iterations_no_error_megatron_llm_issue11.log"])
    assert (result.cls, result.iteration, result.anomaly_iteration) == ("unknown", 204, None)


# Ordering across files.


def test_the_earliest_root_cause_by_timestamp_wins_even_in_the_second_file(tmp_path):
    first = write(
        tmp_path,
        "rank0.log",
        "[2024-08-17 17:40:30] iteration 10",
        "[2024-08-17 17:40:40] RuntimeError: CUDA error: an illegal memory access was encountered",
    )
    second = write(
        tmp_path,
        "rank1.log",
        "[2024-08-17 17:40:35] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    )
    result = triage([first, second])
    assert result.cls == "oom"
    assert (Path(result.first_error.file).name, result.first_error.line) == ("rank1.log", 1)
    assert result.first_error.at == calendar.timegm((2024, 8, 17, 17, 40, 35, 0, 0, 0))
    # Both root lines are evidence, in time order.
    assert [e.cls for e in result.evidence] == ["oom", "software"]
    # Given the other way round the answer is the same: time decides, not the order given.
    assert triage([second, first]).cls == "oom"


def test_lines_without_a_timestamp_inherit_the_one_above(tmp_path):
    log = write(
        tmp_path,
        "train.log",
        "[rank0]:[E0817 17:40:34.227 ProcessGroupNCCL.cpp:1] some info",
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "KeyError: 'model'",
    )
    other = write(tmp_path, "other.log", "2024-08-17T17:40:20 ValueError: earlier, in another file")
    result = triage([log, other])
    # the traceback is placed at 17:40:34 (year 2024 from the other file), after the ValueError
    assert result.first_error.text == "2024-08-17T17:40:20 ValueError: earlier, in another file"
    keyerror = next(e for e in result.evidence if "KeyError" in e.text)
    assert keyerror.at == calendar.timegm((2024, 8, 17, 17, 40, 34, 0, 0, 0)) + 0.227


@pytest.mark.parametrize(
    "line, stamp",
    [
        (
            "[rank0]:[E817 17:40:34.227531918 ProcessGroupNCCL.cpp:1515] x",
            (2024, 8, 17, 17, 40, 34.227531918),
        ),
        ("E0817 17:40:34.227 1234 x.py:1] x", (2024, 8, 17, 17, 40, 34.227)),
        ("2024-08-17 17:40:34 x", (2024, 8, 17, 17, 40, 34)),
        ("2024-08-17T17:40:34.5+0000 node7 kernel: x", (2024, 8, 17, 17, 40, 34.5)),
        ("[2025-09-17 15:16:23] x", (2025, 9, 17, 15, 16, 23)),
        ("Dec  2 11:38:47 worker4 kernel: [  219.470994] x", (2024, 12, 2, 11, 38, 47)),
        ("[Fri Apr  5 21:29:39 2024] NVRM: x", (2024, 4, 5, 21, 29, 39)),
        ("slurmstepd: error: *** JOB 1 ON n1 CANCELLED AT 2021-03-15T18:00:46 ***", (2021, 3, 15, 18, 0, 46)),
    ],
)
def test_timestamp_formats(tmp_path, line, stamp):
    dated = write(tmp_path, "dated.log", "2024-01-01 00:00:00 the year for stamps without one")
    log = write(tmp_path, "x.log", f"{line} RuntimeError: boom")
    result = triage([dated, log])
    year, month, day, hour, minute, second = stamp
    expected = calendar.timegm((year, month, day, hour, minute, int(second), 0, 0, 0)) + second % 1
    assert result.evidence[0].at == pytest.approx(expected)


def test_dmesg_uptime_is_not_wall_time(tmp_path):
    log = write(
        tmp_path, "dmesg.log", "[  219.470994] NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus."
    )
    result = triage([log])
    assert (result.cls, result.first_error.at) == ("hardware", None)


# Classes and their rules.


def test_cascades_alone_are_a_hang_with_no_suspect(tmp_path):
    log = write(
        tmp_path,
        "rank0.log",
        "[rank0]:[E820 11:47:24.069 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600001 milliseconds",
        "n3:1:2 [0] NCCL INFO [Service thread] Connection closed by localRank 0",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    )
    result = triage([log])
    assert (result.cls, result.suspect_nodes) == ("hang", [])
    assert [e.kind for e in result.evidence] == ["cascade"] * 3
    assert "Watchdog caught" in result.first_error.text


def test_a_task_that_exited_before_the_timeouts_is_the_hang_suspect(tmp_path):
    log = write(
        tmp_path,
        "slurm.out",
        "srun: error: gpu12: task 3: Exited with exit code 1",
        "[rank0]:[E ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: x",
    )
    result = triage([log])
    assert (result.cls, result.suspect_nodes) == ("hang", ["gpu12"])
    assert result.first_error.line == 1
    # after the timeouts it is a consequence like the others
    late = write(tmp_path, "late.out", *reversed(log.read_text().splitlines()))
    assert triage([late]).suspect_nodes == []


@pytest.mark.parametrize(
    "exception, cls",
    [
        ("CUDA error: uncorrectable ECC error encountered", "hardware"),
        ("CUDA error: an illegal memory access was encountered", "software"),
        (
            "NCCL error: unhandled system error, NCCL version 2.14.3 Last error: NET/IB : Got completion "
            "from peer 10.0.0.2<1> with error 12",
            "network",
        ),
        ("ncclRemoteError: A call failed possibly due to a network error", "network"),
        ("[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1) ran for 1800000", "hang"),
    ],
)
def test_a_watchdog_exception_is_classified_by_what_it_carries(tmp_path, exception, cls):
    log = write(
        tmp_path,
        "rank2.log",
        f"[rank2]:[E1119 13:21:13.092 ProcessGroupNCCL.cpp:1595] [PG 0 Rank 2] Process group watchdog "
        f"thread terminated with exception: {exception}",
    )
    result = triage([log])
    assert result.cls == cls
    assert result.first_error.kind == ("cascade" if cls == "hang" else "root")


def test_hardware_wins_even_when_it_is_not_the_earliest(tmp_path):
    train = write(
        tmp_path,
        "rank1.log",
        "[2024-12-02 11:38:40] RuntimeError: CUDA error: an illegal memory access was encountered",
    )
    kernel = write(
        tmp_path,
        "kernel.log",
        "Dec  2 11:38:47 worker4 kernel: [  219.470994] NVRM: Xid (PCI:0000:07:00): 79, pid=1, name=python, "
        "GPU has fallen off the bus.",
    )
    result = triage([train, kernel])
    assert (result.cls, result.suspect_nodes) == ("hardware", ["worker4"])
    assert Path(result.first_error.file).name == "kernel.log"
    assert {e.cls for e in result.evidence} == {"hardware", "software"}


def test_rule_check_a_kernel_log_outranks_real_training_side_errors():
    """Not one incident (no public report had both; see SOURCES.md, Gaps): a real illegal memory
    access and a real worker's kernel log given together, as the rule must treat them."""
    result = triage(
        [
            DATA / "software" / "software_illegal_memory_access_nccl_watchdog_axolotl_issue1473.log",
            DATA / "hardware" / "xid48_dbe_xid64_worker4_gpuoperator_issue1146_kernel.log",
        ]
    )
    assert (result.cls, result.suspect_nodes) == ("hardware", ["worker4"])
    assert ": 48, pid=" in result.first_error.text


@pytest.mark.parametrize(
    "line, cls",
    [
        ("NVRM: Xid (PCI:0000:cb:00): 13, pid=1, name=python, Graphics SM Warp Exception", "software"),
        ("NVRM: Xid (PCI:0000:01:00): 31, Ch 00000013, engmask 00000101, intr 10000000", "software"),
        ("NVRM: Xid (PCI:0000:00:05): 43, pid=1045242, name=pt_main_thread, Ch 00000008", "software"),
        ("NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001", "unknown"),
        (
            "NVRM: Xid (PCI:0000:dc:00): 45, pid=1, name=python3, Ch 00000001 caused by previous Xid 149",
            "hardware",
        ),
        ("NVRM: Xid (PCI:0000:00:08): 94, pid='<unknown>', name=<unknown>, Contained: SM (0x1).", "hardware"),
        (
            "NVRM: Xid (PCI:0000:a1:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            "hardware",
        ),
    ],
)
def test_xids(tmp_path, line, cls):
    assert triage([write(tmp_path, "kernel.log", line)]).cls == cls


def test_critical_xids_can_be_given(tmp_path):
    log = write(tmp_path, "kernel.log", "NVRM: Xid (PCI:0000:07:00): 48, pid=1, DBE")
    assert 48 in CRITICAL_XIDS
    assert triage([log]).cls == "hardware"
    assert triage([log], critical_xids=[79]).cls == "unknown"
    assert triage([log], critical_xids=[48]).cls == "hardware"


def test_one_deepspeed_overflow_is_normal_five_in_a_row_are_numerics(tmp_path):
    def overflow(scale: int) -> str:
        return (
            "[2023-06-07 22:16:00,018] [INFO] [loss_scaler.py:181:update_scale] [deepspeed] OVERFLOW! "
            f"Rank 0 Skipping step. Attempted loss scale: {scale}, reducing to {scale // 2}"
        )

    one = write(tmp_path, "one.log", overflow(1024))
    assert triage([one]).cls == "unknown"
    four = write(tmp_path, "four.log", *(overflow(2**k) for k in (8, 7, 6, 5)))
    assert triage([four]).cls == "unknown"
    five = write(tmp_path, "five.log", *(overflow(2**k) for k in (8, 7, 6, 5, 4)))
    result = triage([five])
    assert result.cls == "numerics"
    assert result.first_error.line == 1
    assert len(result.evidence) == 5
    # The scale grew back between them (good steps in between): not five in a row.
    broken = write(
        tmp_path, "broken.log", *(overflow(2**k) for k in (8, 7, 6)), *(overflow(2**k) for k in (8, 7))
    )
    assert triage([broken]).cls == "unknown"


@pytest.mark.parametrize(
    "line, cls",
    [
        ("Epoch 3:  40%|####  | 400/1000 [10:00<15:00, v_num=1, train_loss=nan]", "numerics"),
        ("{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 2e-05, 'epoch': 0.1}", "numerics"),
        (
            "{'loss': 0.1146, 'grad_norm': 0.7724757844977304, 'learning_rate': 2.49e-07, 'epoch': 3.7}",
            "unknown",
        ),
        (
            "[rank0]: RuntimeError: Rank 0, node n7, device 0, iteration 1200: Unexpected result 12.5 "
            "(message='Spiky loss')",
            "numerics",
        ),
        (
            "Rank 0, node n7, device 0, iteration 1200: Unexpected result 12.5 (message='Spiky loss')",
            "numerics",
        ),
        (
            " iteration      300/  1000 | lm loss: 2.1E+00 | grad norm: 0.5 "
            "| number of skipped iterations:   1 | number of nan iterations:   1 |",
            "numerics",
        ),
        ("h1:1:2 [0] enqueue.cc:1085 NCCL WARN Cuda failure 'unspecified launch failure'", "software"),
        ("terminate called after throwing an instance of 'c10::DistBackendError'", "hang"),
        ("  what():  NCCL error: unhandled cuda error, NCCL version 2.18.1", "software"),
        ("  what():  NCCL error: remote process exited or there was a network error", "hang"),
        ("[rank: 0] Handling auto-requeue signal: 10", "preempted"),
        ("requeing job 4242...", "preempted"),
        (
            "submitit WARNING (2022-08-12 02:06:11,453) - Caught signal SIGUSR2 on n1: this job is "
            "preempted.",
            "preempted",
        ),
        ("WARNING: Logging before flag parsing goes to stderr.", "unknown"),
        ("    except KeyError:", "unknown"),
        ('    raise ValueError(f"bad {x}")', "unknown"),
    ],
)
def test_single_lines(tmp_path, line, cls):
    assert triage([write(tmp_path, "x.log", line)]).cls == cls


def test_loss_scale_at_minimum_is_numerics(tmp_path):
    log = write(
        tmp_path, "x.log", "Exception: Current loss scale already at minimum - cannot decrease scale anymore."
    )
    assert triage([log]).cls == "numerics"


def local_iteration(i: int, loss: float, grad: float = 1.23) -> str:
    """The line the other test loop prints (tests/helpers/core_loop.py), behind srun's label."""
    return f"0: iteration {i} consumed {i * 8} lr {1e-4:.3e} loss {loss:.6f} grad_norm {grad:.6f}"


def test_a_loss_spike_is_numerics_at_its_iteration(tmp_path):
    lines = [local_iteration(i, 2.0 + 0.01 * (i % 3)) for i in range(1, 26)]
    smooth = write(tmp_path, "smooth.log", *lines, local_iteration(26, 5.9))  # < 3x the median: no spike
    assert triage([smooth]).cls == "unknown"
    spiky = write(tmp_path, "spiky.log", *lines, local_iteration(26, 9.5), local_iteration(27, 2.1))
    result = triage([spiky])
    assert (result.cls, result.anomaly_iteration, result.iteration) == ("numerics", 26, 27)
    assert result.first_error.line == 26
    # A spike needs 20 iterations before it to measure against.
    early = write(tmp_path, "early.log", *lines[:10], local_iteration(11, 9.5))
    assert triage([early]).cls == "unknown"


def test_nan_in_the_local_jobs_iteration_line(tmp_path):
    log = write(tmp_path, "x.log", local_iteration(1, 5.1), local_iteration(2, float("nan"), float("nan")))
    result = triage([log])
    assert (result.cls, result.anomaly_iteration, result.iteration) == ("numerics", 2, 2)


def test_megatron_exit_code_16_and_17(tmp_path):
    log = write(
        tmp_path,
        "x.log",
        "[rank0]:[E ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout",
    )
    r16 = triage([log], exit_code=16)
    assert (r16.exit_code, r16.megatron, r16.cls) == (16, "exclude-node-and-rerun", "hang")
    r17 = triage([log], exit_code=17)
    assert (r17.exit_code, r17.megatron, r17.cls) == (17, "stop", "numerics")
    assert "17" in r17.reason
    none = triage([log], exit_code=1)
    assert (none.exit_code, none.megatron) == (1, None)
    # 17 with hardware evidence stays hardware
    ecc = write(tmp_path, "ecc.log", "RuntimeError: CUDA error: uncorrectable ECC error encountered")
    assert triage([ecc], exit_code=17).cls == "hardware"
    assert triage([ecc], exit_code=17).megatron == "stop"


def test_exit_codes_16_and_17_in_srun_lines_name_the_node(tmp_path):
    log = write(
        tmp_path,
        "slurm.out",
        "[rank0]:[E ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout",
        "srun: error: n2: task 1: Exited with exit code 16",
    )
    result = triage([log])
    assert (result.exit_code, result.megatron, result.suspect_nodes) == (16, "exclude-node-and-rerun", ["n2"])
    stop = write(tmp_path, "stop.out", "srun: error: n5: task 4: Exited with exit code 17")
    result = triage([stop])
    assert (result.cls, result.exit_code, result.megatron, result.suspect_nodes) == (
        "numerics",
        17,
        "stop",
        ["n5"],
    )
    assert result.first_error.text == "srun: error: n5: task 4: Exited with exit code 17"
    # The caller's exit code wins over the log's.
    assert triage([log], exit_code=17).megatron == "stop"


@pytest.mark.parametrize(
    "line",
    [
        "[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "1: RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "[E ProcessGroupNCCL.cpp:916] [Rank 1] NCCL watchdog thread terminated with exception: CUDA error: "
        "uncorrectable ECC error encountered",
    ],
)
def test_the_layout_maps_rank_prefixes_to_nodes(tmp_path, line):
    log = write(tmp_path, "train.log", line)
    assert triage([log], layout={0: "n1", 1: "n2"}).suspect_nodes == ["n2"]
    assert triage([log]).suspect_nodes == []  # no layout: no guess
    assert triage([log], layout={0: "n1"}).suspect_nodes == []


NCCL_INFO = (
    "gpu-node-17:12345:12399 [3] NCCL INFO comm 0x55 rank 5 nranks 16 cudaDev 3 busId 4b000 - Init COMPLETE"
)


def test_a_per_rank_logs_nccl_lines_name_the_host_of_its_root_lines(tmp_path):
    """A per-rank log names its host in NCCL's `host:pid:tid [local rank]` lines: a root line of
    that file without a host of its own belongs to that host (issue 24, item 7)."""
    log = write(
        tmp_path,
        "rank5.log",
        NCCL_INFO,
        "[rank5]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
    )
    other = write(
        tmp_path,
        "rank0.log",
        "gpu-node-02:2222:2299 [0] NCCL INFO comm 0x56 rank 0 nranks 16 cudaDev 0 - Init COMPLETE",
        "[rank0]:[E ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout",
    )
    result = triage([other, log])
    assert (result.cls, result.suspect_nodes) == ("hardware", ["gpu-node-17"])
    assert result.first_error.nodes == ("gpu-node-17",)
    # The host line may come after the root line (NCCL's abort messages at the end).
    late = write(tmp_path, "late.log", *reversed(log.read_text().splitlines()))
    assert triage([late]).suspect_nodes == ["gpu-node-17"]
    # A line that names its node, or whose rank the layout maps, keeps its own.
    assert triage([log], layout={5: "n5"}).suspect_nodes == ["n5"]


def test_a_file_whose_nccl_lines_name_two_hosts_gives_no_host_to_its_other_lines(tmp_path):
    log = write(
        tmp_path,
        "job.log",
        NCCL_INFO,
        "gpu-node-18:4444:4499 [3] NCCL INFO comm 0x57 rank 13 nranks 16 cudaDev 3 - Init COMPLETE",
        "[rank5]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
    )
    assert triage([log]).suspect_nodes == []
    # The srun --label form of one host's lines is still one host.
    labelled = write(
        tmp_path, "labelled.log", f"5: {NCCL_INFO}", "5: torch.OutOfMemoryError: CUDA out of memory."
    )
    assert triage([labelled]).suspect_nodes == ["gpu-node-17"]


def test_a_preempted_per_rank_log_still_names_no_suspect(tmp_path):
    log = write(
        tmp_path,
        "rank5.log",
        NCCL_INFO,
        "slurmstepd: error: *** STEP 12.0 ON gpu-node-17 CANCELLED AT 2026-12-01T04:00:00 "
        "DUE TO TIME LIMIT ***",
    )
    result = triage([log])
    assert (result.cls, result.suspect_nodes) == ("preempted", [])


def test_a_real_per_rank_log_gives_its_host_to_the_line_without_one():
    """DeepSpeed#6875: rank 4's log; `ncclRemoteError: ...` has no host of its own, and the file's
    NCCL lines name one host, 50428e4af543."""
    result = triage([DATA / "network" / "ib_status12_status5_ncclremoteerror_rank4_deepspeed_issue6875.log"])
    remote = next(e for e in result.evidence if e.text.startswith("ncclRemoteError:"))
    assert (remote.line, remote.nodes) == (19, ("50428e4af543",))


def test_open_mpis_output_tag_does_not_hide_the_nccl_host(tmp_path):
    log = write(
        tmp_path,
        "job.log",
        "Fri Aug 11 12:31:45 2023[1,0]<stdout>:gpu-node-17:1850301:1881341 [0] transport.cc:154 NCCL WARN "
        "Cuda failure 'invalid argument'",
    )
    assert triage([log]).suspect_nodes == ["gpu-node-17"]


def test_a_worker_dead_of_sigsegv_is_its_own_fault_a_killed_one_is_not(tmp_path):
    agent = (
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: {code}) "
        "local_rank: 1 (pid: 5528)"
    )
    segv = write(tmp_path, "segv.log", agent.format(code=-11))
    assert (triage([segv]).cls, triage([segv]).first_error.kind) == ("software", "root")
    for code in (-9, -6, 1):
        other = write(tmp_path, f"x{code}.log", agent.format(code=code))
        assert triage([other]).cls == "hang", code


def test_a_dataloader_worker_killed_from_outside_points_at_the_killer(tmp_path):
    killed = "RuntimeError: DataLoader worker (pid 629) is killed by signal: Killed."
    alone = write(tmp_path, "alone.log", killed)
    assert (triage([alone]).cls, triage([alone]).first_error.kind) == ("hang", "cascade")
    with_dmesg = write(
        tmp_path,
        "dmesg.log",
        killed,
        "Memory cgroup out of memory: Killed process 629 (train) total-vm:14119556kB",
    )
    result = triage([with_dmesg])
    assert (result.cls, result.first_error.line) == ("oom", 2)


def test_fairseqs_loss_scale_collapse_is_numerics_and_a_recovered_scale_starts_over(tmp_path):
    def overflows(*scales):
        return [f"| WARNING: overflow detected, setting loss scale to: {x}" for x in scales]

    collapse = write(tmp_path, "collapse.log", *overflows(0.25, 0.125, 0.0625, 0.03125, 0.015625))
    result = triage([collapse])
    assert (result.cls, result.first_error.line) == ("numerics", 1)
    # Four in a row, the scale back up, four again: never five in a row.
    recovered = write(tmp_path, "recovered.log", *overflows(64, 32, 16, 8, 128, 64, 32, 16))
    assert triage([recovered]).cls == "unknown"
    # At the start of training, 2^16 and halving: the initial search, not a failure.
    search = write(tmp_path, "search.log", *overflows(*(2.0**k for k in range(15, 9, -1))))
    assert triage([search]).cls == "unknown"


def test_suspects_come_only_from_root_lines_deduplicated_in_order(tmp_path):
    log = write(
        tmp_path,
        "x.log",
        "[rank3]:[E ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation timeout",
        "n9:1:2 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.9<1> with error 12, vendor err 129",
        "n4:1:2 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.4<1> with error 12, vendor err 129",
        "n9:1:2 [1] NCCL WARN NET/IB : Got completion from peer 10.0.0.4<2> with error 12, vendor err 129",
    )
    result = triage([log], layout={3: "n3"})
    assert (result.cls, result.suspect_nodes) == ("network", ["n9", "n4"])


def test_our_local_jobs_ecc_fault_with_the_layout(tmp_path):
    """The local job's ecc fault (infra/local_job/faults.py) raises this on rank 1; srun --label
    prefixes it."""
    log = write(
        tmp_path,
        "train.log",
        local_iteration(1, 4.2),
        "1: RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "1: CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
        "below might be incorrect.",
        "0: [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
        "peer [127.0.0.1]:6026",
    )
    result = triage([log], layout={0: "n1", 1: "n2"})
    assert (result.cls, result.suspect_nodes, result.iteration) == ("hardware", ["n2"], 1)
    assert result.first_error.text == "1: RuntimeError: CUDA error: uncorrectable ECC error encountered"


def test_the_gloo_connection_closed_is_a_cascade(tmp_path):
    log = write(
        tmp_path,
        "train.log",
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:561] "
        "Connection closed by peer [127.0.0.1]:6026",
    )
    result = triage([log], layout={0: "n1", 1: "n2"})
    assert (result.cls, result.suspect_nodes, result.first_error.kind) == ("hang", [], "cascade")


def test_megatrons_nan_check_names_the_node(tmp_path):
    log = write(
        tmp_path,
        "train.log",
        local_iteration(1, 4.2),
        "[rank1]: RuntimeError: Rank 1, node vm, device 0, iteration 0: Unexpected result nan "
        "(message='found NaN in local grad norm for bucket #0 in backward pass before data-parallel "
        "communication collective')",
    )
    result = triage([log], layout={0: "n1", 1: "n2"})
    assert (result.cls, result.suspect_nodes, result.anomaly_iteration) == ("numerics", ["vm"], 0)


def test_preempted_has_no_suspects_but_node_failure_names_the_node(tmp_path):
    result = triage([DATA / "preempted" / "preempted_time_limit_2node_srun_desitarget_issue628_slurm.out"])
    assert (result.cls, result.suspect_nodes) == ("preempted", [])
    failed = write(
        tmp_path,
        "slurm.out",
        "[rank0]:[E ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout",
        "slurmstepd: error: *** JOB 77 ON gpu-a17 CANCELLED AT 2024-05-01T10:00:00 DUE TO NODE FAILURE ***",
    )
    result = triage([failed])
    assert (result.cls, result.suspect_nodes) == ("preempted", ["gpu-a17"])


def test_a_step_cancelled_by_srun_after_a_task_died_is_not_preemption(tmp_path):
    """srun --kill-on-bad-exit (our job script) cancels the step once a task dies."""
    log = write(
        tmp_path,
        "slurm.out",
        "0: iteration 6 consumed 48 lr 1.000e-04 loss 4.100000 grad_norm 1.200000",
        "srun: error: n2: task 1: Killed",
        "srun: Terminating StepId=12.0",
        "slurmstepd: error: *** STEP 12.0 ON n1 CANCELLED AT 2026-12-01T04:00:00 ***",
        "srun: error: n1: task 0: Terminated",
    )
    result = triage([log], layout={0: "n1", 1: "n2"})
    assert (result.cls, result.suspect_nodes, result.iteration) == ("hang", ["n2"], 6)
    assert result.first_error.text == "srun: error: n2: task 1: Killed"
    # The same cancellation with no task failure before it is a cancellation.
    alone = write(tmp_path, "alone.out", *log.read_text().splitlines()[3:])
    assert triage([alone]).cls == "preempted"


def test_the_earliest_error_decides_against_a_later_cancellation(tmp_path):
    log = write(
        tmp_path,
        "slurm.out",
        "2024-05-01 09:00:00 KeyError: 'layers.0.weight'",
        "slurmstepd: error: *** JOB 77 ON gpu-a17 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME LIMIT ***",
    )
    assert triage([log]).cls == "software"


# Inputs.


def test_an_empty_file_is_unknown(tmp_path):
    result = triage([write(tmp_path, "empty.log")])
    assert (result.cls, result.suspect_nodes, result.first_error, result.evidence) == (
        "unknown",
        [],
        None,
        [],
    )
    assert "nothing recognised" in result.reason


def test_no_files_is_unknown():
    assert triage([]).cls == "unknown"


def test_an_unreadable_path_names_the_file(tmp_path):
    missing = tmp_path / "no-such.log"
    with pytest.raises(Unreadable) as raised:
        triage([write(tmp_path, "ok.log", "KeyError: 'x'"), missing])
    assert str(missing) in str(raised.value)
    assert raised.value.exit_code == 2
    under_a_file = write(tmp_path, "file.log", "x") / "child.log"
    with pytest.raises(Unreadable, match="child.log"):
        triage([under_a_file])


def test_a_directory_is_a_usage_error(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    with pytest.raises(UsageError, match="logs") as raised:
        triage([folder])
    assert not isinstance(raised.value, Unreadable)
    assert raised.value.exit_code == 2


def test_bytes_that_are_not_utf8_are_replaced(tmp_path):
    log = tmp_path / "bin.log"
    log.write_bytes(b"\xff\xfe garbage\r\nRuntimeError: CUDA error: uncorrectable ECC error encountered\r\n")
    result = triage([log])
    assert result.cls == "hardware"
    assert result.first_error.text == "RuntimeError: CUDA error: uncorrectable ECC error encountered"


def test_a_long_log_is_read_streaming(tmp_path):
    """The reader's peak memory (every Python allocation, traced) does not grow with the log: 40,000
    iteration lines then the error peak within 32 KB of 10,000 lines then the error, where a
    reader that loads the whole file would need 2.4 MB more; the answer is right in both. Traced
    in a process of its own: in the test process, other threads' allocations count too."""
    import subprocess
    import sys

    logs, sizes = [], []
    for lines in (10_000, 40_000):
        log = tmp_path / f"long-{lines}.log"
        with log.open("w") as f:
            for i in range(1, lines + 1):
                f.write(local_iteration(i, 3.0 - i * 1e-6) + "\n")
            f.write("1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
        logs.append(str(log))
        sizes.append(log.stat().st_size)
    probe = (
        "import json, sys, tracemalloc\n"
        "from tasks.recovery.triage import triage\n"
        "for log in sys.argv[1:]:\n"
        "    tracemalloc.start()\n"
        "    found = triage([log], layout={0: 'n1', 1: 'n2'})\n"
        "    peak = tracemalloc.get_traced_memory()[1]\n"
        "    tracemalloc.stop()\n"
        "    answer = [found.cls, found.suspect_nodes, found.iteration, found.first_error.line, peak]\n"
        "    print(json.dumps(answer))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *logs], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = [json.loads(line) for line in done.stdout.splitlines()]
    assert [answer[:4] for answer in found] == [["oom", ["n2"], n, n + 1] for n in (10_000, 40_000)]
    peaks = [answer[4] for answer in found]
    assert peaks[1] - peaks[0] < 32 * 1024, f"peaks {peaks} bytes for logs of {sizes} bytes"


def test_a_200_mb_line_is_read_in_bounded_memory_and_kept_to_a_few_kb(tmp_path):
    """One line of 200 MB that starts like an OOM (the issue's log): triage in a process of its
    own, its peak memory measured by the kernel (VmHWM of the process: ru_maxrss would count
    the test process it was forked from), holds far less than the line, and its JSON holds the
    first error once, cut to a few KB with its length."""
    import subprocess
    import sys

    log = tmp_path / "huge.log"
    size = 200 << 20
    with log.open("wb") as f:
        f.write(b"[rank1]: torch.OutOfMemoryError: CUDA out of memory. ")
        chunk = b"x" * (1 << 20)
        for _ in range(size >> 20):
            f.write(chunk)
        f.write(b"\n[rank1]: done\n")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys; from tasks.recovery.triage import triage; "
            "print(json.dumps(triage([sys.argv[1]], layout={1: 'n2'}).to_dict())); "
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])",
            str(log),
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 0
    answer, peak_kb = out.decode().rsplit("\n", 2)[:2]
    peak_mb = int(peak_kb) / 1024
    assert peak_mb < 150, f"triage of a 200 MB line peaked at {peak_mb:.0f} MB"
    found = json.loads(answer)
    assert len(out) < 20_000 and found["class"] == "oom" and found["suspect_nodes"] == ["n2"]
    assert found["first_error"]["text"].endswith(f"[... {size + 53} bytes in all]")
    assert found["evidence"][0] == {
        "file": str(log),
        "line": 1,
        "class": "oom",
        "kind": "root",
        "first_error": True,
    }


def test_evidence_is_capped_and_the_first_error_kept(tmp_path):
    log = write(tmp_path, "x.log", *(f"[rank{i}]: KeyError: 'k{i}'" for i in range(120)))
    result = triage([log])
    assert 1 <= len(result.evidence) <= 50
    assert result.first_error.text == "[rank0]: KeyError: 'k0'"
    assert result.evidence[0] == result.first_error


# Output.


def test_to_dict(tmp_path):
    result = triage([write(tmp_path, "x.log", "[rank1]: KeyError: 'k'")], layout={1: "n2"})
    as_dict = result.to_dict()
    assert list(as_dict) == [
        "class",
        "suspect_nodes",
        "first_error",
        "evidence",
        "reason",
        "exit_code",
        "megatron",
        "iteration",
        "anomaly_iteration",
        "suspect_ranks",
        "stuck_collective",
        "flight_recorder",
        "infrastructure",
        "suspect_gpus",
        "save_iteration",
    ]
    assert as_dict["class"] == "software"
    # Flight Recorder's keys are empty where no dumps were read (tests/test_flight_recorder.py).
    assert (as_dict["suspect_ranks"], as_dict["stuck_collective"], as_dict["flight_recorder"]) == (
        [],
        None,
        None,
    )
    assert as_dict["suspect_nodes"] == ["n2"]
    assert as_dict["first_error"] == {
        "file": str(tmp_path / "x.log"),
        "line": 1,
        "text": "[rank1]: KeyError: 'k'",
    }
    # The first error's text is there once: its evidence entry points at it.
    assert as_dict["evidence"] == [
        {"file": str(tmp_path / "x.log"), "line": 1, "class": "software", "kind": "root", "first_error": True}
    ]
    assert triage([]).to_dict()["first_error"] is None


def test_line_starts_with_the_class_word(tmp_path):
    result = triage(
        [write(tmp_path, "train.log", "1: RuntimeError: CUDA error: uncorrectable ECC error encountered")],
        layout={1: "n2"},
    )
    text = result.line()
    assert text.split()[0] == "hardware"
    assert "n2" in text
    assert f"{tmp_path / 'train.log'}:1: 1: RuntimeError: CUDA error: uncorrectable ECC" in text
    assert triage([]).line().split()[0] == "unknown"


# torchrun's ChildFailedError summary as it prints it (torch 2.x; this block from the local job's
# killed rank, the host and rank as on a cluster).
TORCHRUN_SUMMARY = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "pretrain.py FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "  <NO_OTHER_FAILURES>",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-12-02_05:59:12",
    "  host      : gpu-node-07",
    "  rank      : 13 (local_rank: 5)",
    "  exitcode  : {code}",
    "  error_file: <N/A>",
    "  traceback : {traceback}",
    "============================================================",
)


def summary(code: str, traceback: str) -> list[str]:
    return [line.format(code=code, traceback=traceback) for line in TORCHRUN_SUMMARY]


def test_torchruns_summary_names_the_rank_that_failed_first_and_its_host(tmp_path):
    killed = summary("-9 (pid: 9246)  (SIGKILL)", "Signal 9 (SIGKILL) received by PID 9246")
    log = write(tmp_path, "job.out", "Sending process 9245 closing signal SIGTERM", *killed)
    result = triage([log])
    assert (result.cls, result.suspect_nodes) == ("hang", ["gpu-node-07"])
    assert result.first_error.text == (
        "Root Cause (first observed failure): rank 13 (local_rank: 5) on gpu-node-07, "
        "exitcode -9 (pid: 9246)  (SIGKILL)"
    )
    assert result.first_error.line == killed.index("Root Cause (first observed failure):") + 2


def test_megatrons_exit_16_in_torchruns_summary_is_the_jobs_and_megatron_names_the_node(tmp_path):
    # The rerun state machine's 16 (local job: --rerun-mode validate_results, a NaN fault on rank 1):
    # every rank exits 16, so the summary's first rank is no suspect; Megatron's own line is.
    log = write(
        tmp_path,
        "job.out",
        "ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 1 at iteration #4 "
        "invocation #1 (message='found NaN in local grad norm for bucket #0 in backward pass before "
        "data-parallel communication collective')",
        "ERROR:megatron.core.rerun_state_machine:Rank 1, node gpu-node-03, device 0, iteration #4: First "
        "rerun: unexpected result is reproducible within the tolerance (nan = nan). Need to rerun on a "
        "different GPU to verify correctness.!",
        *summary(
            "16 (pid: 4242)", "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        ),
    )
    result = triage([log])
    assert (result.cls, result.exit_code, result.megatron) == ("numerics", 16, "exclude-node-and-rerun")
    assert result.suspect_nodes == ["gpu-node-03"]


def test_torchruns_summary_behind_srun_labels_cut_short_or_with_exit_16_alone(tmp_path):
    killed = summary("-9 (pid: 9246)  (SIGKILL)", "Signal 9 (SIGKILL) received by PID 9246")
    # srun --label prefixes every line of the task that printed it.
    labelled = write(tmp_path, "labelled.out", *(f"3: {line}" for line in killed))
    assert triage([labelled]).suspect_nodes == ["gpu-node-07"]
    # A log that ends inside the block still has the host and the exit code.
    cut = write(tmp_path, "cut.out", *killed[: killed.index("  error_file: <N/A>")])
    assert triage([cut]).suspect_nodes == ["gpu-node-07"]
    # Exit 16 alone: the job's code, but the first rank to exit 16 is no suspect.
    alone = write(tmp_path, "alone.out", *summary("16 (pid: 4242)", "To enable traceback see: x"))
    result = triage([alone])
    assert (result.exit_code, result.megatron, result.suspect_nodes) == (16, "exclude-node-and-rerun", [])


def test_flight_recorder_names_the_ranks_a_16_gpu_job_waited_on_in_dumps_others_recorded(capsys):
    """NVRx's dumps of a 16-rank Megatron MoE job on GPUs with a fault injected into two ranks
    (tests/data/flight_recorder/SOURCES.md): the suspects are exactly the missing ranks of NVRx's
    own analyser, every one an injected rank, from dumps that hold only in-flight entries (the
    faulty ranks' dumps hold none at all in the LOCK_GIL cases)."""
    from tests.triage_accuracy import hang_report, measure_hangs

    hangs = measure_hangs()
    assert len(hangs) == 4
    for hang in hangs:
        assert hang.got == hang.missing and set(hang.got) <= set(hang.injected), hang
    with capsys.disabled():
        print(f"\n{hang_report(hangs)}")


# Megatron-Core's rerun state machine's second verdicts, in its own words (rerun_state_machine.py's
# log_failure: "Rank R, node N, device D, iteration #I: MESSAGE!") and its tracker file's lines: no
# public log of a real run holds them (searched; only the first rerun's, Megatron-LM #5026, and
# the local job's own transient case, tests/test_faults.py).
SM = "ERROR:megatron.core.rerun_state_machine:"
TRACKED = (
    "ts=2026-12-06 10:00:0{} node={} device={} jobID=4242 rank=1 iteration=9 status=RerunValidationStatus.{}"
)


def test_a_result_reproduced_on_another_gpu_is_the_data_and_names_no_node(tmp_path):
    log = write(
        tmp_path,
        "resumed.log",
        " [2026-12-06 10:01:00] iteration        8/     100 | lm loss: 2.1E+00 |",
        f"{SM}Unexpected result nan on rank 1 at iteration #9 invocation #1 (message='found NaN')",
        "WARNING:megatron.core.rerun_state_machine:Second rerun: unexpected result is reproducible on a "
        "different GPU, therefore it was likely correct (nan = nan)",
        f"{SM}Rank 1, node gpu-b07, device 3, iteration #9: Correct result (but possible Application error) "
        "(found NaN)!",
    )
    found = triage([log], exit_code=17)
    assert found.cls == "data" and found.suspect_nodes == []
    assert found.anomaly_iteration == 9 and "the data at that position" in found.reason
    assert found.first_error.text.startswith("WARNING:megatron.core.rerun_state_machine:Second rerun")


def test_a_result_another_gpu_could_not_reproduce_convicts_the_first_gpu_from_the_tracker(tmp_path):
    log = write(
        tmp_path,
        "resumed.log",
        "WARNING:megatron.core.rerun_state_machine:Second rerun: unexpected result is not reproducible on a "
        "different GPU, therefore was likely incorrect (2.03 != nan)",
        f"{SM}Rank 1, node gpu-b07, device 3, iteration #9: Possible persistent error!!",
    )
    found = triage([log], exit_code=17)
    assert found.cls == "hardware" and "on another GPU" in found.reason
    assert found.suspect_nodes == []  # gpu-b07 reran it and got it right: not the suspect
    tracker = write(
        tmp_path,
        "tracker.txt",
        TRACKED.format(1, "gpu-a03", 5, "INITIAL_RUN result=nan message='found NaN'"),
        TRACKED.format(2, "gpu-a03", 5, "FIRST_RERUN_REPRODUCIBLE result=nan message='found NaN'"),
        TRACKED.format(3, "gpu-b07", 3, "SECOND_RERUN_NOT_REPRODUCIBLE result=2.03 message='found NaN'"),
    )
    found = triage([log, tracker], exit_code=17)
    assert found.cls == "hardware" and found.suspect_nodes == ["gpu-a03"]
    assert found.suspect_gpus == ["gpu-a03:5"]  # the GPU the first rerun reproduced it on


def test_a_transient_fault_names_the_gpu_megatron_reran_it_on(tmp_path):
    """From Megatron-LM's own loop here: the log's line and the tracker file name rank 1's GPU."""
    for name in ("first_rerun_not_reproducible.log", "first_rerun_not_reproducible_tracker.txt"):
        found = triage([DATA.parent / "megatron" / "rerun" / name])
        assert (found.cls, found.suspect_nodes, found.suspect_gpus) == ("hardware", ["vm"], ["vm:1"])
        assert found.to_dict()["suspect_gpus"] == ["vm:1"]
    assert triage([DATA.parent / "megatron" / "rerun" / "second_rerun_reproducible.log"]).suspect_gpus == []


@pytest.mark.parametrize(
    "first, second, verdict",
    [
        (
            ("gpu-a03", 5, "INITIAL_RUN result=nan"),
            ("gpu-a03", 5, "FIRST_RERUN_NOT_REPRODUCIBLE result=2.03"),
            ("hardware", ["gpu-a03"]),
        ),
        (
            ("gpu-a03", 5, "FIRST_RERUN_REPRODUCIBLE result=nan"),
            ("gpu-b07", 3, "SECOND_RERUN_REPRODUCIBLE result=nan"),
            ("data", []),
        ),
    ],
    ids=["transient", "data"],
)
def test_the_tracker_alone_tells_a_transient_fault_and_the_data_apart(first, second, verdict, tmp_path):
    lines = [
        TRACKED.format(n, node, device, f"{status} message='found NaN'")
        for n, (node, device, status) in enumerate((first, second), 1)
    ]
    found = triage([write(tmp_path, "tracker.txt", *lines)])
    assert (found.cls, found.suspect_nodes) == verdict


def test_flight_recorder_reads_json_dumps_as_it_reads_pickled_ones(tmp_path):
    """NCCL's JSON dumps (``_dump_nccl_trace_json``, torchcomms) hold the same fields: the same
    dumps written as JSON give the same suspects."""
    import pickle

    from tasks.recovery.triage.flight_recorder import flight_recorder
    from tests.triage_accuracy import hang_cases

    folder, missing, _ = hang_cases()[1]
    for dump in folder.glob("_dump_*"):
        data = pickle.loads(dump.read_bytes())  # the project's own test data, not a dump it triages
        (tmp_path / dump.name).write_text(json.dumps(data))
    assert (
        tuple(flight_recorder(tmp_path).suspect_ranks)
        == missing
        == tuple(flight_recorder(folder).suspect_ranks)
    )


CANCELLED_AT = "slurmstepd: error: *** JOB 4242 ON gpu-a03 CANCELLED AT 2026-12-06T10:00:00"


@pytest.mark.parametrize(
    "line, taken",
    [
        (f"{CANCELLED_AT} DUE TO PREEMPTION ***", True),
        ("Spot instance interruption notice: termination is imminent", True),
        (f"{CANCELLED_AT} DUE TO TIME LIMIT ***", False),
        (f"{CANCELLED_AT} DUE TO NODE FAILURE ***", False),
        (f"{CANCELLED_AT} ***", False),
    ],
    ids=["preemption", "spot", "time-limit", "node-failure", "cancelled"],
)
def test_a_preemption_is_the_infrastructures_and_a_time_limit_or_a_lost_node_is_not(line, taken, tmp_path):
    found = triage([write(tmp_path, "slurm.out", line)])
    assert found.cls == "preempted"
    assert found.infrastructure == (line[:240] if taken else None)
