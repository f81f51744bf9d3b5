"""terarec.cli"""
