"""LightningModules, one per task."""

from lightning_memopt.tasks.face_recognition import FaceRecognitionModule

__all__ = ["FaceRecognitionModule"]
