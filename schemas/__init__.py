"""FlatBuffers wire schemas, flatc-generated code and a validating codec."""
