# embed_configs.cmake: writes OUT, one `{"stem", R"json(...)json"},` entry per JSON file in FILES
# (a |-separated list).
string(REPLACE "|" ";" FILES "${FILES}")
set(body "// Generated from configs/*.json by src/engine/embed_configs.cmake; do not edit.\n")
foreach(f ${FILES})
  get_filename_component(stem ${f} NAME_WE)
  file(READ ${f} text)
  string(APPEND body "{\"${stem}\", R\"json(${text})json\"},\n")
endforeach()
file(WRITE ${OUT} "${body}")
