"""kvbalance.server"""
