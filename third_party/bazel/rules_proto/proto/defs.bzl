"""Offline stub of @rules_proto//proto:defs.bzl: the native rules of Bazel 4, re-exported."""

proto_lang_toolchain = native.proto_lang_toolchain
proto_library = native.proto_library
ProtoInfo = ProtoInfo
