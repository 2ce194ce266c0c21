# Installs headers, libraries, bin/funcol (and bin/funcol-gloo-launch with gloo), the CMake
# package (find_package(funcol) -> funcol::funcol) and funcol.pc.
include(CMakePackageConfigHelpers)

get_property(_funcol_libs GLOBAL PROPERTY FUNCOL_LIBRARIES)
install(TARGETS funcol funcol_headers ${_funcol_libs}
  EXPORT funcolTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/funcol DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET funcol_cli)
  install(TARGETS funcol_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
if(FUNCOL_WITH_GLOO)
  # Starts the ranks of a user's own gloo program on one host.
  install(PROGRAMS src/dist/gloo/gloo_launch.sh DESTINATION ${CMAKE_INSTALL_BINDIR}
    RENAME funcol-gloo-launch)
endif()

set(FUNCOL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/funcol)
install(EXPORT funcolTargets NAMESPACE funcol:: DESTINATION ${FUNCOL_CMAKE_DIR})
configure_package_config_file(cmake/funcolConfig.cmake.in
  ${PROJECT_BINARY_DIR}/funcolConfig.cmake INSTALL_DESTINATION ${FUNCOL_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/funcolConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/funcolConfig.cmake ${PROJECT_BINARY_DIR}/funcolConfigVersion.cmake
  DESTINATION ${FUNCOL_CMAKE_DIR})

# pkg-config: libraries in link order (a layer before the layers it uses).
set(FUNCOL_PC_LIBS "")
foreach(_lib IN LISTS _funcol_libs)
  string(PREPEND FUNCOL_PC_LIBS "-l${_lib} ")
endforeach()

# The static libraries' own dependencies (the process backends link MPI / Gloo) as -L/-l flags:
# a full path names this machine's file, versioned at that (/usr/lib/libgloo.so.0.5.0). -L only
# for directories the linker does not search anyway.
set(_funcol_pc_dirs "")
set(_funcol_pc_names "")
function(_funcol_pc_add_lib lib)
  if(lib MATCHES "^-")
    list(APPEND _funcol_pc_names "${lib}")
  elseif(IS_ABSOLUTE "${lib}")
    get_filename_component(_dir "${lib}" DIRECTORY)
    get_filename_component(_file "${lib}" NAME)
    if(NOT _file MATCHES "${FUNCOL_LIB_FILE_REGEX}")
      message(FATAL_ERROR "funcol.pc: cannot write ${lib} as -l<name>")
    endif()
    list(APPEND _funcol_pc_names "-l${CMAKE_MATCH_1}")
    if(NOT _dir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES AND NOT _dir IN_LIST _funcol_pc_dirs)
      list(APPEND _funcol_pc_dirs "${_dir}")
    endif()
  else()
    list(APPEND _funcol_pc_names "-l${lib}")
  endif()
  set(_funcol_pc_dirs "${_funcol_pc_dirs}" PARENT_SCOPE)
  set(_funcol_pc_names "${_funcol_pc_names}" PARENT_SCOPE)
endfunction()
if(FUNCOL_WITH_GLOO)
  get_target_property(_gloo_lib gloo LOCATION)
  _funcol_pc_add_lib("${_gloo_lib}")
  _funcol_pc_add_lib("${FUNCOL_HIREDIS_LIBRARY}")
endif()
get_property(_funcol_pc_extra GLOBAL PROPERTY FUNCOL_PC_EXTRA_LIBS)
foreach(_lib IN LISTS _funcol_pc_extra)
  _funcol_pc_add_lib("${_lib}")
endforeach()
if(FUNCOL_WITH_MPI)
  foreach(_lib IN LISTS MPI_CXX_LIBRARIES)
    _funcol_pc_add_lib("${_lib}")
  endforeach()
endif()
set(FUNCOL_PC_DEPS "")
foreach(_dir IN LISTS _funcol_pc_dirs)
  string(APPEND FUNCOL_PC_DEPS "-L${_dir} ")
endforeach()
foreach(_name IN LISTS _funcol_pc_names)
  string(APPEND FUNCOL_PC_DEPS "${_name} ")
endforeach()

# Eigen's headers, which funcol's headers use (core links it PUBLIC): through eigen3.pc where
# pkg-config knows it, else its include directory.
set(FUNCOL_PC_REQUIRES "fmt")
set(FUNCOL_PC_CFLAGS "")
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(FUNCOL_PC_EIGEN3 QUIET eigen3)
endif()
if(FUNCOL_PC_EIGEN3_FOUND)
  string(APPEND FUNCOL_PC_REQUIRES " eigen3")
else()
  get_target_property(_eigen_includes Eigen3::Eigen INTERFACE_INCLUDE_DIRECTORIES)
  foreach(_dir IN LISTS _eigen_includes)
    string(APPEND FUNCOL_PC_CFLAGS " -I${_dir}")
  endforeach()
endif()
configure_file(cmake/funcol.pc.in ${PROJECT_BINARY_DIR}/funcol.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/funcol.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
