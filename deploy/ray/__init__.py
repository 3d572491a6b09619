"""specdec on Ray: each service's gRPC server hosted in a Ray actor, drafter replicas
owned by a controller actor that scales them, the orchestrator following the controller.

    from deploy.ray import launcher
    deployment = launcher.up(target="smollm2-135m-instruct", draft="smollm2-135m-draft", num_drafters=2)
    deployment.scale_drafters(3)
"""
