# Installs headers, libraries, bin/funcol, the CMake package (find_package(funcol) ->
# funcol::funcol) and funcol.pc.
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
# The static libraries' own dependencies, as full paths (the process backends link MPI / Gloo).
set(FUNCOL_PC_DEPS "")
if(FUNCOL_WITH_GLOO)
  get_target_property(_gloo_lib gloo LOCATION)
  string(APPEND FUNCOL_PC_DEPS "${_gloo_lib} ${FUNCOL_HIREDIS_LIBRARY} ")
endif()
get_property(_funcol_pc_extra GLOBAL PROPERTY FUNCOL_PC_EXTRA_LIBS)
foreach(_lib IN LISTS _funcol_pc_extra)
  string(APPEND FUNCOL_PC_DEPS "${_lib} ")
endforeach()
if(FUNCOL_WITH_MPI)
  foreach(_lib IN LISTS MPI_CXX_LIBRARIES)
    string(APPEND FUNCOL_PC_DEPS "${_lib} ")
  endforeach()
endif()
configure_file(cmake/funcol.pc.in ${PROJECT_BINARY_DIR}/funcol.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/funcol.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
