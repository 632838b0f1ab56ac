# Third-party libraries, found through pkg-config (Debian -dev packages; scripts/setup installs them).
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS C)

# tdm_require_pkg(<prefix> <pkg-config name> <Debian package>): fail with the package to install.
macro(tdm_require_pkg prefix module debpkg)
  pkg_check_modules(${prefix} IMPORTED_TARGET ${module})
  if(NOT ${prefix}_FOUND)
    message(FATAL_ERROR "missing library '${module}': install the Debian package ${debpkg} "
                        "(scripts/setup does this)")
  endif()
endmacro()

tdm_require_pkg(YAML yaml-0.1 libyaml-dev)
tdm_require_pkg(PCRE2 libpcre2-8 libpcre2-dev)
tdm_require_pkg(XXHASH libxxhash libxxhash-dev)
tdm_require_pkg(JANSSON jansson libjansson-dev)
if(TANDEM_BUILD_TESTS)
  tdm_require_pkg(CMOCKA cmocka libcmocka-dev)
endif()
tdm_require_pkg(ZMQ libzmq libzmq3-dev)
tdm_require_pkg(PROTOBUFC libprotobuf-c libprotobuf-c-dev)
tdm_require_pkg(MHD libmicrohttpd libmicrohttpd-dev)
# base64 of /v1/embeddings (sodium_bin2base64); libzmq3-dev depends on libsodium-dev already
tdm_require_pkg(SODIUM libsodium libsodium-dev)

find_program(TANDEM_PROTOC_C protoc-c)
if(NOT TANDEM_PROTOC_C)
  message(FATAL_ERROR "missing program 'protoc-c': install the Debian package protobuf-c-compiler "
                      "(scripts/setup does this)")
endif()

# libsystemd (Debian libsystemd-dev), optional: with it the daemons tell systemd when they are
# ready (sd_notify READY=1, STATUS=, STOPPING=1; the units in deploy/systemd are Type=notify).
# Without it they build and run the same, and such units would time out at start: use
# Type=exec units then (docs/operations.md "Deployment").
option(TANDEM_SYSTEMD "Use libsystemd for sd_notify when it is found" ON)
set(TANDEM_HAVE_SYSTEMD OFF)
if(TANDEM_SYSTEMD)
  pkg_check_modules(SYSTEMD IMPORTED_TARGET libsystemd)
  if(SYSTEMD_FOUND)
    set(TANDEM_HAVE_SYSTEMD ON)
  else()
    message(STATUS "libsystemd not found (Debian package libsystemd-dev; scripts/setup installs "
                   "it): building without sd_notify support, the Type=notify units in "
                   "deploy/systemd will not work with these binaries")
  endif()
endif()
