# Runs in script mode (cmake -P) from ctest: install -> configure consumer -> build -> run.
# Each step must succeed; the consumer itself checks the version and the backends it was told to expect.
foreach(var ZERO8_BUILD_DIR WORK_DIR CONSUMER_DIR GENERATOR CXX_COMPILER EXPECT_VERSION)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "package_test.cmake: ${var} not set")
  endif()
endforeach()

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test: ${what} failed (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "package test: ${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run_step("install" ${CMAKE_COMMAND} --install ${ZERO8_BUILD_DIR} --prefix ${prefix})

foreach(f lib/cmake/zero8/zero8Config.cmake lib/cmake/zero8/zero8ConfigVersion.cmake
          include/zero8/error.h include/zero8/version.h bin/zero8-bench)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "package test: ${f} was not installed under ${prefix}")
  endif()
endforeach()

run_step("configure consumer" ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/consumer -G ${GENERATOR}
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
  -DZERO8_REQUIRED_VERSION=${EXPECT_VERSION})
run_step("build consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
run_step("run consumer" ${WORK_DIR}/consumer/zero8_consumer ${EXPECT_VERSION} ${EXPECT_CUDA} ${EXPECT_MPI}
  ${EXPECT_NCCL})
message(STATUS "${step_output}")
run_step("run installed zero8-bench" ${prefix}/bin/zero8-bench bandwidth --numel 100000 --repeat 2)
