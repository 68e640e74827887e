# Compile units and the compiler cache.
#
# Note [Compile units]
# Every translation unit that includes libtorch pays ~9 s of parsing before its
# first line of its own (an empty file with <torch/torch.h>: 8.8 s at -O3 on
# this project's 2-core machines), so a build of ~240 small files spent most of
# its time in headers. meshtrain_target_sources() compiles a target's .cpp files
# in larger units instead: the files of one room (meshtrain/comm, tests/parallel,
# ...: the first two parts of their path) are #included, in the order given,
# into generated units of at most MESHTRAIN_UNITY_LINES lines each. A unit holds
# files of one room only, so adding a file rebuilds that room alone.
#
# The generated units name their files by the path from the project root (found
# through the include path), never by an absolute path, so a clone in any folder
# generates the same bytes; with the compiler cache's base_dir set to the clone
# (below), a second clone on the same machine compiles nothing that the first
# already did.
#
# Files in one unit share a scope: a helper in an anonymous namespace, a
# file-level `using` or a macro is seen by the files after it. Name helpers so
# that they say what they do (or put them in their class), and #undef a macro at
# the end of the file that defines it.
#
# Which file opens a unit follows the files' lengths, so a file that grows can
# move the next one to the head of a new unit, where it no longer sees what the
# files before it included. Every grouped file is therefore a dependency of the
# configure step: a build after an edit of one configures again (about 2 s) and
# regroups as a clean clone would, rather than keep the old units and pass
# where the clone's build fails (a file missing an #include of its own).
#
# MESHTRAIN_UNITY=OFF compiles every file alone: for an editor's per-file view,
# or to check that a file compiles on its own includes.
#
# There is no precompiled header: gcc's .gch of <torch/torch.h> is 690 MB and
# differs byte for byte between two compiles of the same input, so every unit
# compiled against it misses the compiler cache in any other clone; restoring it
# also cost 4.5 s per unit, half of parsing the headers outright.

option(MESHTRAIN_UNITY "Compile the .cpp files of a folder together in larger units (Note [Compile units])" ON)
set(MESHTRAIN_UNITY_LINES 2500 CACHE STRING "Largest compile unit, in source lines (Note [Compile units])")

# meshtrain_target_sources(<target> [ONE_ROOM] <file>...): adds the files to the
# target, grouped into compile units by room (ONE_ROOM: the target's files are
# one room, for a test program whose folders hold a file or two each). Paths are
# relative to the current source folder, as for target_sources(). A file that
# needs compile options of its own goes to target_sources() instead, and stays a
# unit by itself.
function(meshtrain_target_sources target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "ONE_ROOM" "" "")
  set(sources ${arg_UNPARSED_ARGUMENTS})
  if(NOT MESHTRAIN_UNITY)
    target_sources(${target} PRIVATE ${sources})
    return()
  endif()
  set(rooms "")
  foreach(file IN LISTS sources)
    get_filename_component(absolute "${file}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    file(RELATIVE_PATH relative "${PROJECT_SOURCE_DIR}" "${absolute}")
    if(arg_ONE_ROOM)
      string(REGEX MATCH "^[^/]+" room "${relative}")
    else()
      string(REGEX MATCH "^[^/]+/[^/]+" room "${relative}")
    endif()
    string(MAKE_C_IDENTIFIER "${room}" room)
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${absolute}")
    if(NOT room IN_LIST rooms)
      list(APPEND rooms ${room})
      set(files_${room} "")
    endif()
    list(APPEND files_${room} "${relative}")
  endforeach()

  set(folder "${CMAKE_BINARY_DIR}/unity/${target}")
  set(units "")
  foreach(room IN LISTS rooms)
    set(index 0)
    set(lines 0)
    set(content "")
    foreach(relative IN LISTS files_${room})
      file(READ "${PROJECT_SOURCE_DIR}/${relative}" text)
      string(REGEX MATCHALL "\n" newlines "${text}")
      list(LENGTH newlines file_lines)
      math(EXPR after "${lines} + ${file_lines}")
      if(lines GREATER 0 AND after GREATER MESHTRAIN_UNITY_LINES)
        _meshtrain_write_unit("${folder}/${room}_${index}.cpp" "${content}")
        list(APPEND units "${folder}/${room}_${index}.cpp")
        math(EXPR index "${index} + 1")
        set(after ${file_lines})
        set(content "")
      endif()
      string(APPEND content "#include \"${relative}\"\n")
      set(lines ${after})
    endforeach()
    _meshtrain_write_unit("${folder}/${room}_${index}.cpp" "${content}")
    list(APPEND units "${folder}/${room}_${index}.cpp")
  endforeach()
  target_sources(${target} PRIVATE ${units})
  # The included files are sources of the target for editors and for `cmake
  # --build` dependency scanning, but are not compiled by themselves.
  set(originals "")
  foreach(file IN LISTS sources)
    get_filename_component(absolute "${file}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND originals "${absolute}")
  endforeach()
  set_source_files_properties(${originals} PROPERTIES HEADER_FILE_ONLY ON)
  target_sources(${target} PRIVATE ${originals})
endfunction()

# Writes a unit only when its text changed, so that configuring again rebuilds nothing.
function(_meshtrain_write_unit path content)
  set(text "// Generated by cmake/MeshtrainUnity.cmake (Note [Compile units]); do not edit.\n${content}")
  if(EXISTS "${path}")
    file(READ "${path}" old)
    if(old STREQUAL text)
      return()
    endif()
  endif()
  file(WRITE "${path}" "${text}")
endfunction()

# The compiler cache: ccache when installed (scripts/setup.sh installs it),
# unless the configure names a launcher of its own. base_dir is the folder that
# holds both the sources and the build, so the paths on a compile line are
# relative and two clones of one commit share every cached unit.
option(MESHTRAIN_CCACHE "Compile through ccache when it is installed" ON)
if(MESHTRAIN_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(MESHTRAIN_CCACHE_PROGRAM ccache)
  if(MESHTRAIN_CCACHE_PROGRAM)
    set(base "${PROJECT_SOURCE_DIR}")
    while(NOT base STREQUAL "/")
      file(RELATIVE_PATH inside "${base}" "${PROJECT_BINARY_DIR}")
      if(NOT inside MATCHES "^\\.\\.")
        break()
      endif()
      get_filename_component(base "${base}" DIRECTORY)
    endwhile()
    if(base STREQUAL "/")
      set(base "${PROJECT_SOURCE_DIR}")
    endif()
    set(CMAKE_CXX_COMPILER_LAUNCHER env "CCACHE_BASEDIR=${base}" ${MESHTRAIN_CCACHE_PROGRAM})
    message(STATUS "meshtrain: compiler cache ${MESHTRAIN_CCACHE_PROGRAM} (base_dir ${base})")
  endif()
endif()
