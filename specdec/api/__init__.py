"""The generated gRPC code of protos/specdec/api (python -m specdec.protogen): the wire
between the services, apart from the services themselves."""
