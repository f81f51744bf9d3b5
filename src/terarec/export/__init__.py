"""terarec.export"""
