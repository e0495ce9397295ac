# Every test carries two labels: a tier and a subject.
#   tier    fast: the set to run before a commit (`ctest -L fast`, about two
#           minutes on 2 cores); slow: the rest. CI runs both.
#   subject what it tests (`ctest -L planner`), the first rule that matches.
# fsdp_label_tests() labels the tests of the directory it is called in (set
# at the end of each tests/ CMakeLists.txt); a test no subject rule matches
# stops the configure step. The test tests.labels checks that each test has
# one tier and one subject and that the fast tier covers every subject.

# subject, then the regular expression of the test names it takes
set(FSDP_TEST_SUBJECTS
  gpu-emu     "^(emu|gpu)\\."
  network     "^net\\."
  checkpoint  "^(distributed\\.ckpt\\.|lua\\.test_(checkpoint|safetensors|strict_loads)$|fuzz\\.(checkpoint|safetensors))"
  compression "^distributed\\.compress\\."
  planner     "^(lua\\.test_(plan|plan_time|meta)$|distributed\\.memory)"
  distributed "^(distributed|mpi)\\."
  kernels     "^(c\\.test_(kernels_|matmul_paths|classifier)|lua\\.test_(fused|bf16_ops|attention_qkv|linear|chunked_head|classifier_loss)$)"
  autograd    "^(c\\.test_grad_|lua\\.test_(autograd|grad_accumulate)$)"
  model       "^(c\\.test_optim|lua\\.test_(nn|gpt2_golden|gpt2_golden_bf16|sample|tokenizer|data|training_helpers|shard)$|fuzz\\.shards)"
  core        "^(arch\\.|c\\.test_(core|io|sched)|lua\\.test_(tensor|device|errors|io|no_follow|strict_inputs|one_rank|config|progress)$|fuzz\\.options)"
  tools       "^(sh|docs|tests)\\."
)

# slow: the names matching one of these, less those matching FSDP_FAST_ANYWAY
set(FSDP_SLOW_TESTS
  "^(emu|gpu|sh)\\."
  "^fuzz\\.(options|checkpoint)"
  "^lua\\.test_(plan|progress|tokenizer)$"
  "^distributed\\.(agree_options|recipe\\.|ckpt\\.export\\.torch)"
  "^distributed\\.(equiv|compute_copy|memory)\\..*\\.np[34]$"
  "^mpi\\.(test_comm_watchdog|desync\\.(early|stop))"
  "^mpi\\.desync\\..*\\.np3$"
  "^mpi\\.test_comm\\.np4$"
)
set(FSDP_FAST_ANYWAY
  "^emu\\.(align|order|wmma|guard\\.|errors\\.)"
  "^emu\\.lua\\.test_(strict_inputs|io|errors|tensor|device|meta|fused|bf16_ops|safetensors|shard)$"
  "^gpu\\.(test_cuda_rng_host|test_cuda_kernels_emu\\.(device_cpu|small_smem|fault)|test_cuda_matmul_lt_emu)"
  "^sh\\.(test_binding_drift|test_install|test_metrics)$"
)

function(fsdp_matches_any out name)
  set(hit FALSE)
  foreach(re IN LISTS ARGN)
    if(name MATCHES "${re}")
      set(hit TRUE)
      break()
    endif()
  endforeach()
  set(${out} ${hit} PARENT_SCOPE)
endfunction()

function(fsdp_label_tests)
  get_property(tests DIRECTORY PROPERTY TESTS)
  list(LENGTH FSDP_TEST_SUBJECTS n)
  math(EXPR last "${n} - 1")
  foreach(t IN LISTS tests)
    set(subject "")
    foreach(i RANGE 0 ${last} 2)
      math(EXPR j "${i} + 1")
      list(GET FSDP_TEST_SUBJECTS ${i} s)
      list(GET FSDP_TEST_SUBJECTS ${j} re)
      if(t MATCHES "${re}")
        set(subject ${s})
        break()
      endif()
    endforeach()
    if(subject STREQUAL "")
      message(FATAL_ERROR "tests/labels.cmake: test ${t} matches no subject rule: add it to FSDP_TEST_SUBJECTS")
    endif()
    fsdp_matches_any(slow ${t} ${FSDP_SLOW_TESTS})
    fsdp_matches_any(anyway ${t} ${FSDP_FAST_ANYWAY})
    if(slow AND NOT anyway)
      set(tier slow)
    else()
      set(tier fast)
    endif()
    set_property(TEST ${t} APPEND PROPERTY LABELS ${tier} ${subject})
  endforeach()
endfunction()
