"""Generated gRPC stubs for proto/tidepool.proto and proto/agent.proto.

Do not edit: `make proto-python` regenerates them with Debian's protoc and
grpc_python_plugin (packages protobuf-compiler, protobuf-compiler-grpc), so
they match Debian's python3-protobuf and python3-grpcio. protoc writes
absolute imports (``import tidepool_pb2``); the Makefile rewrites them to
package-relative ones (``from . import tidepool_pb2``) so that the stubs
load as ``tidepool._proto`` without touching sys.path.
"""
