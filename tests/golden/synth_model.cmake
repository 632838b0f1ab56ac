# synth_model.cmake - makes the synthetic model a golden file was made from, for ctest (a
# FIXTURES_SETUP test before test_golden compares Tandem with it): reads the golden JSON's
# "synth" recipe (shape, type, seed, vocabulary file and its SHA-256), runs `tandem model synth`
# with it, and fails with a message unless the file's SHA-256 is the JSON's model_sha256.
#
# cmake -DTANDEM=PATH -DGOLDEN=FILE.json -DOUT=FILE.gguf -P synth_model.cmake
# The vocabulary file is looked for where test_golden looks for models: $TANDEM_GEMMA3_MODEL
# (when the vocabulary is Gemma 3 270M's), else $XDG_CACHE_HOME/tandem/models, else
# ~/.cache/tandem/models (scripts/setup installs SmolLM2; --model gemma3-270m, Gemma 3 270M).
cmake_minimum_required(VERSION 3.19) # string(JSON)

foreach(var TANDEM GOLDEN OUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "synth_model.cmake: -D${var}= is required")
  endif()
endforeach()

file(READ "${GOLDEN}" doc)
string(JSON want_sha GET "${doc}" model_sha256)
string(JSON generator GET "${doc}" generator)
foreach(key shape type seed vocab vocab_sha256)
  string(JSON ${key} GET "${doc}" synth ${key})
endforeach()

if(DEFINED ENV{TANDEM_GEMMA3_MODEL} AND NOT "$ENV{TANDEM_GEMMA3_MODEL}" STREQUAL ""
   AND vocab STREQUAL "gemma-3-270m-q4_k_m.gguf")
  set(vocab_path "$ENV{TANDEM_GEMMA3_MODEL}")
elseif(DEFINED ENV{XDG_CACHE_HOME} AND NOT "$ENV{XDG_CACHE_HOME}" STREQUAL "")
  set(vocab_path "$ENV{XDG_CACHE_HOME}/tandem/models/${vocab}")
else()
  set(vocab_path "$ENV{HOME}/.cache/tandem/models/${vocab}")
endif()
if(NOT EXISTS "${vocab_path}")
  message(FATAL_ERROR "${vocab_path} is missing: the synthetic model of ${GOLDEN} takes its "
                      "vocabulary from it (run scripts/setup; --model gemma3-270m for Gemma's)")
endif()

# the same file as the golden's: skip the work
if(EXISTS "${OUT}")
  file(SHA256 "${OUT}" have_sha)
  if(have_sha STREQUAL want_sha)
    message(STATUS "${OUT}: up to date (sha256 ${have_sha})")
    return()
  endif()
endif()

file(SHA256 "${vocab_path}" have_vocab_sha)
if(NOT have_vocab_sha STREQUAL vocab_sha256)
  message(FATAL_ERROR "${vocab_path} has sha256 ${have_vocab_sha}, but ${GOLDEN}'s model was "
                      "made with the vocabulary of a file with sha256 ${vocab_sha256}")
endif()

execute_process(
  COMMAND "${TANDEM}" model synth --shape ${shape} --type ${type} --seed ${seed}
          --vocab "${vocab_path}" -o "${OUT}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tandem model synth failed (exit ${rc})")
endif()
file(SHA256 "${OUT}" have_sha)
if(NOT have_sha STREQUAL want_sha)
  file(REMOVE "${OUT}")
  message(FATAL_ERROR
          "tandem model synth --shape ${shape} --type ${type} --seed ${seed} wrote a file with "
          "sha256 ${have_sha}, not the ${want_sha} that ${GOLDEN} was made from: synth's "
          "weights or metadata changed. If that was meant, regenerate the golden file with "
          "${generator}; the logits of the new file are unknown.")
endif()
message(STATUS "${OUT}: sha256 ${have_sha}, as ${GOLDEN} records")
