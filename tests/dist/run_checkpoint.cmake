# Checkpoint scenarios that take several jobs (ckpt_phase.cpp under mpirun, and the tool):
#   -DMODE=resize -DFROM=<N> -DTO=<M>      save with N ranks, load with M: every block identical,
#         [-DHYPER=1]                       training goes on and equals a single-process reference
#                                           (HYPER: the model in three param groups, ckpt_hyper_params)
#   -DMODE=crash -DNP=<K> -DPOINT=<p> -DRANK=<r> -DALLOWED=<steps a,b> [-DSTEPS=<n>] [-DTAG=<t>]
#                [-DEXCHANGE=0]             kill -9 rank r at save point p (ZERO8_CKPT_CRASH_AT):
#                                           latest then names a complete tag that verifies and loads
#                                           at an allowed step, and the next save works
#   -DMODE=tool -DNP=<K>                    zero8-checkpoint inspect / verify / to-fp32 and their exit codes
#   -DMODE=tool_hyper -DNP=<K>              inspect and to-fp32 of a checkpoint with param groups
# Always: -DMPIEXEC=<mpirun> -DPHASE=<ckpt_phase> -DTOOL=<zero8-checkpoint> -DWORK=<scratch directory>
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(dir "${WORK}/ckpt")
string(TIMESTAMP t_start "%s")

# phase(<np> <ok|fail> args...): np 0 runs one process without mpirun. Output in PHASE_OUT.
function(phase np expect)
  if(np EQUAL 0)
    set(cmd "${PHASE}" ${ARGN})
  else()
    set(cmd "${MPIEXEC}" -np ${np} --oversubscribe "${PHASE}" ${ARGN})
  endif()
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${cmd} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
  string(TIMESTAMP t1 "%s")
  math(EXPR dt "${t1} - ${t0}")
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "[${dt} s, exit ${rc}] np ${np}: ckpt_phase ${shown}")
  if(expect STREQUAL "ok" AND NOT rc EQUAL 0)
    message(FATAL_ERROR "ckpt_phase ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
  if(expect STREQUAL "fail" AND rc EQUAL 0)
    message(FATAL_ERROR "ckpt_phase ${ARGN} succeeded but must fail:\n${out}\n${err}")
  endif()
  set(PHASE_OUT "${out}\n${err}" PARENT_SCOPE)
endfunction()

# tool(<exit code> args...): runs zero8-checkpoint, checks its exit code. Output in TOOL_OUT.
function(tool expect_rc)
  execute_process(COMMAND "${TOOL}" ${ARGN} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 60)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "[exit ${rc}] zero8-checkpoint ${shown}")
  if(NOT rc EQUAL expect_rc)
    message(FATAL_ERROR "zero8-checkpoint ${ARGN}: exit ${rc}, expected ${expect_rc}:\n${out}\n${err}")
  endif()
  set(TOOL_OUT "${out}\n${err}" PARENT_SCOPE)
endfunction()

function(expect_match text regex)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "expected output matching '${regex}', got:\n${text}")
  endif()
endfunction()

if(HYPER)
  set(hyper --hyper)
endif()

if(MODE STREQUAL "resize")
  phase(${FROM} ok save "${dir}" 3 --dump "${WORK}/dump" ${hyper})
  phase(${TO} ok resize "${dir}" "${WORK}/dump" ${hyper})
  message(STATUS "${PHASE_OUT}")

elseif(MODE STREQUAL "crash")
  # The previous checkpoint (step 3), then a save that resumes from it and is killed at POINT.
  phase(${NP} ok save "${dir}" 3)
  if(NOT DEFINED STEPS)
    set(STEPS 2)
  endif()
  set(args save "${dir}" ${STEPS} --resume)
  if(DEFINED TAG)
    list(APPEND args --tag ${TAG})
  endif()
  set(ENV{ZERO8_CKPT_CRASH_AT} "${POINT}:${RANK}")
  if(DEFINED EXCHANGE)
    set(ENV{ZERO8_CKPT_RENAME_EXCHANGE} "${EXCHANGE}")
  endif()
  phase(${NP} fail ${args})
  unset(ENV{ZERO8_CKPT_CRASH_AT})
  unset(ENV{ZERO8_CKPT_RENAME_EXCHANGE})
  # It died from the SIGKILL at that point, not from something else, and before save returned.
  expect_match("${PHASE_OUT}" "signal 9|Killed")
  if(PHASE_OUT MATCHES "CKPT_PHASE saved")
    message(FATAL_ERROR "the save completed: point ${POINT} was never reached\n${PHASE_OUT}")
  endif()
  file(GLOB left RELATIVE "${dir}" "${dir}/*" "${dir}/.*")
  message(STATUS "after the crash: ${left}")
  tool(0 verify "${dir}")
  expect_match("${TOOL_OUT}" "OK ")
  tool(0 inspect "${dir}")
  phase(${NP} ok check "${dir}" ${ALLOWED})
  message(STATUS "${PHASE_OUT}")

elseif(MODE STREQUAL "tool")
  phase(${NP} ok save "${dir}" 2)
  phase(${NP} ok save "${dir}" 2 --resume --dump "${WORK}/dump")
  tool(0 inspect "${dir}")
  message(STATUS "${TOOL_OUT}")
  expect_match("${TOOL_OUT}" "latest: global_step4")
  expect_match("${TOOL_OUT}" "global_step2 +step 2, world size ${NP}")
  expect_match("${TOOL_OUT}" "step 4, world size ${NP}")
  # Bytes per part of the test model (ckpt_util.h): 23087 parameters, 22876 in the 8-bit group
  # (358 blocks of 64), 211 in the fp32 group; AdamW keeps 2 states.
  expect_match("${TOOL_OUT}" "bytes: master 92348, codes 45752, absmax 2864, fp32 state 1688, ")
  expect_match("${TOOL_OUT}" "23087 elements \\(8bit group 22876, fp32 group 211\\), working dtype bfloat16")
  expect_match("${TOOL_OUT}" "param groups: 1\n")
  expect_match("${TOOL_OUT}" "state_dict: not listed")
  tool(0 verify "${dir}")
  math(EXPR nfiles "${NP} + 1")
  expect_match("${TOOL_OUT}" "OK .*global_step4: ${nfiles} files")
  tool(0 verify "${dir}" --tag global_step2)
  tool(0 verify "${dir}/global_step4")
  tool(0 to-fp32 "${dir}" "${WORK}/weights.safetensors")
  # A save without the module's state_dict (no engine): the trained parameters, and a note saying so.
  expect_match("${TOOL_OUT}" "note: this checkpoint lists no state_dict")
  phase(0 ok fp32-compare "${WORK}/weights.safetensors" "${WORK}/dump")
  # Faults: one flipped byte, a missing shard, no directory, no checkpoint, bad usage.
  file(COPY "${dir}/" DESTINATION "${WORK}/bad")
  phase(0 ok flip "${WORK}/bad/global_step4/zero8_shard_rank1.bin" middle)
  tool(1 verify "${WORK}/bad")
  expect_match("${TOOL_OUT}" "zero8_shard_rank1.bin: checksum mismatch")
  tool(1 to-fp32 "${WORK}/bad" "${WORK}/bad.safetensors")
  expect_match("${TOOL_OUT}" "zero8_shard_rank1.bin: checksum mismatch")
  if(EXISTS "${WORK}/bad.safetensors")
    message(FATAL_ERROR "to-fp32 of a corrupt checkpoint left an output file")
  endif()
  tool(0 verify "${WORK}/bad" --tag global_step2)
  file(REMOVE "${WORK}/bad/global_step2/zero8_shard_rank0.bin")
  tool(1 verify "${WORK}/bad" --tag global_step2)
  expect_match("${TOOL_OUT}" "zero8_shard_rank0.bin: missing")
  tool(1 verify "${WORK}/nowhere")
  expect_match("${TOOL_OUT}" "nowhere: missing")
  file(MAKE_DIRECTORY "${WORK}/empty")
  tool(1 verify "${WORK}/empty")
  expect_match("${TOOL_OUT}" "latest: missing")
  tool(1 inspect "${WORK}/empty")
  tool(2 frobnicate "${dir}")
  tool(2 verify)

elseif(MODE STREQUAL "tool_hyper")
  # The model in three param groups (ckpt_util.h, ckpt_hyper_params): each group's run starts on a
  # state block of 64, so the 8-bit group holds 22950 elements (74 of padding), the fp32 group 285 (74).
  phase(${NP} ok save "${dir}" 2 --hyper --dump "${WORK}/dump")
  tool(0 inspect "${dir}")
  message(STATUS "${TOOL_OUT}")
  expect_match("${TOOL_OUT}" "23087 elements \\(8bit group 22950, fp32 group 285\\)")
  expect_match("${TOOL_OUT}" "param groups: 3 \\(0: 3 tensors, 5004 elements. 1: 3 tensors, 9120 elements. 2: 3 tensors, 8963 elements\\), padding between their runs: 8bit 74, fp32 74 elements")
  tool(0 verify "${dir}")
  tool(0 to-fp32 "${dir}" "${WORK}/weights.safetensors")
  phase(0 ok fp32-compare "${WORK}/weights.safetensors" "${WORK}/dump" --hyper)
  # The same comparison with the offsets of the model without param groups fails: the export did
  # place each tensor by its run.
  phase(0 fail fp32-compare "${WORK}/weights.safetensors" "${WORK}/dump")
  expect_match("${PHASE_OUT}" "differs from the saved masters")

else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()

string(TIMESTAMP t_end "%s")
math(EXPR total "${t_end} - ${t_start}")
message(STATUS "${MODE} scenario passed in ~${total} s")
file(REMOVE_RECURSE "${WORK}")
