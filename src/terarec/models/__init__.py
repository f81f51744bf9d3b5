"""terarec.models"""
