# Compiler flags shared by every Tandem target: warnings, sanitizers, CUDA detection.

set(TANDEM_C_WARNINGS -Wall -Wextra -Wshadow -Wpointer-arith -Wstrict-prototypes
    -Wmissing-prototypes -Wvla -Wformat=2 -Wno-unused-parameter)
if(TANDEM_WERROR)
  list(APPEND TANDEM_C_WARNINGS -Werror)
endif()

set(TANDEM_SANITIZE_FLAGS "")
if(TANDEM_ASAN)
  list(APPEND TANDEM_SANITIZE_FLAGS -fsanitize=address -fno-omit-frame-pointer)
endif()
if(TANDEM_UBSAN)
  list(APPEND TANDEM_SANITIZE_FLAGS -fsanitize=undefined -fno-sanitize-recover=undefined)
endif()

# tdm_target_defaults(<target>): warnings and sanitizers for one C target.
function(tdm_target_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:C>:${TANDEM_C_WARNINGS}>
                         ${TANDEM_SANITIZE_FLAGS})
  if(TANDEM_SANITIZE_FLAGS)
    target_link_options(${target} PRIVATE ${TANDEM_SANITIZE_FLAGS})
  endif()
endfunction()

# CUDA: AUTO builds the CUDA parts when nvcc is found; ON requires it.
set(TANDEM_HAVE_CUDA OFF)
if(NOT TANDEM_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(TANDEM_HAVE_CUDA ON)
  elseif(TANDEM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TANDEM_CUDA=ON but no CUDA compiler (nvcc) was found; "
                        "install the CUDA toolkit or configure with -DTANDEM_CUDA=OFF")
  endif()
endif()
